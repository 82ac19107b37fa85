"""Keep rank processes tied to the instance that started them, and notice silent ones.

* Every rank is started from one thread that lives as long as the instance process: Linux
  sends the parent-death signal when the *thread* that forked a child ends, so ranks started
  from a short-lived thread (a pool rebuild) would be killed with that thread.
* A rank asks for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), then checks that the
  parent is still the one that started it, which closes the race with a parent that died
  before the request. A killed model stub then leaves no rank (and no memory) behind.
* A rank's heartbeat thread writes ``time.monotonic()`` (system-wide on Linux) into shared
  memory; it keeps beating inside long collectives and compute steps (both release the GIL).
  The instance reads the beats and the ranks' ``/proc`` state to tell a frozen rank (SIGSTOP,
  a debugger) from a slow one long before the collective timeout.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1
BEAT_S = 0.2

_spawn_jobs: queue.Queue[tuple[Callable[[], None], queue.Queue]] | None = None
_spawn_lock = threading.Lock()


def _spawn_loop(jobs: queue.Queue[tuple[Callable[[], None], queue.Queue]]) -> None:
    while True:
        job, done = jobs.get()
        try:
            job()
            done.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            done.put(exc)


def start_processes(procs: Sequence[Any]) -> None:
    """``p.start()`` for each process, from the instance's long-lived spawning thread."""
    global _spawn_jobs
    with _spawn_lock:
        if _spawn_jobs is None:
            _spawn_jobs = queue.Queue()
            threading.Thread(target=_spawn_loop, args=(_spawn_jobs,), name="neopp-spawner",
                             daemon=True).start()
    def start_all() -> None:
        for p in procs:
            p.start()

    done: queue.Queue = queue.Queue(maxsize=1)
    _spawn_jobs.put((start_all, done))
    error = done.get()
    if error is not None:
        raise error


def die_with_parent(parent: int) -> None:
    """In a rank, first thing: SIGKILL when ``parent`` dies; leave now if it already has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):  # not Linux: the idle loop's getppid check remains
        pass
    if os.getppid() != parent:
        os._exit(1)


def start_heartbeat(beats: Any, rank: int) -> None:
    """A daemon thread that stamps ``beats[rank]`` every BEAT_S seconds."""
    def beat() -> None:
        while True:
            beats[rank] = time.monotonic()
            time.sleep(BEAT_S)

    beats[rank] = time.monotonic()
    threading.Thread(target=beat, name="neopp-heartbeat", daemon=True).start()


def proc_state(pid: int) -> str:
    """The one-letter state of ``pid`` in /proc ('T' stopped, 't' traced, 'Z' zombie...), '' if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def silent_rank(pids: Sequence[int], beats: Any, silence_s: float) -> str | None:
    """Why the first frozen rank is frozen, or None: stopped by a signal, or no heartbeat for
    ``silence_s`` (a rank that cannot run even its heartbeat thread cannot finish a step)."""
    now = time.monotonic()
    for rank, pid in enumerate(pids):
        quiet = now - beats[rank]
        state = proc_state(pid)
        if state in ("T", "t") and quiet > 2 * BEAT_S:
            return f"rank {rank} (pid {pid}) is stopped (no heartbeat for {quiet:.1f}s)"
        if quiet > silence_s:
            return f"rank {rank} (pid {pid}) stopped responding (no heartbeat for {quiet:.1f}s)"
    return None
