"""Kill a Python stub without taking tritonserver down with it.

A stub shares process-shared *robust* mutexes with tritonserver (its health flag, its message
queues, its shared-memory pool: Triton 2.51's Python backend creates them with boost, kind
``PTHREAD_MUTEX_ROBUST | PTHREAD_PROCESS_SHARED``). When a stub dies holding one, the server's
next lock of it returns ``EOWNERDEAD``, boost throws ``lock_exception``, nothing catches it and
tritonserver aborts (signal 6). A SIGKILL from us (a stopped stub, a stuck load) or from the
test harness lands in such a window now and then, more often on a loaded machine, where a
thread can be preempted while it holds a lock.

So the one way the launcher kills a stub: stop it (SIGSTOP), wait until every thread is
stopped, read each thread's robust-futex list from the kernel (``get_robust_list``, then the
list head in ``/proc/<pid>/mem``), and SIGKILL only when no thread holds or is taking a robust
mutex. Otherwise resume it (SIGCONT) and look again a moment later, within a bound. A stub that
someone else stopped is never resumed (one Triton has given up on aborts the server when it runs
again): if it holds a lock, it cannot be killed safely and the caller restarts the server.
"""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import struct
import time
from collections.abc import Callable
from pathlib import Path

from ..procs import is_stopped, start_ticks

_GET_ROBUST_LIST = {"x86_64": 274, "aarch64": 100}.get(platform.machine())
try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:  # not Linux: locks cannot be read, kills are plain
    _LIBC = None


def _tasks(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return []


def _stop_pending(pid: int) -> bool:
    """True when a SIGSTOP sent to the process has not stopped it yet."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return False
    masks = [int(line.split()[1], 16) for line in lines if line.startswith(("ShdPnd:", "SigPnd:"))]
    return any(mask & (1 << (signal.SIGSTOP - 1)) for mask in masks)


def _task_stopped(pid: int, tid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # gone: it holds nothing
    return state in ("T", "t", "Z", "X")


def _robust_head(tid: int) -> int | None:
    """Address of the thread's robust-list head (0: none registered); None when it cannot be read."""
    if _LIBC is None or _GET_ROBUST_LIST is None:
        return None
    head, size = ctypes.c_void_p(), ctypes.c_size_t()
    if _LIBC.syscall(_GET_ROBUST_LIST, tid, ctypes.byref(head), ctypes.byref(size)) != 0:
        return None
    return head.value or 0


def holds_robust_lock(pid: int) -> bool | None:
    """True when a thread of ``pid`` holds a robust mutex or is between taking and releasing one;
    None when the kernel's lists cannot be read. Meaningful only while the process is stopped."""
    try:
        mem = open(f"/proc/{pid}/mem", "rb", buffering=0)
    except OSError:
        return None
    with mem:
        for tid in _tasks(pid):
            head = _robust_head(tid)
            if head is None:
                return None
            if head == 0:
                continue
            try:
                mem.seek(head)
                first, _offset, pending = struct.unpack("<QqQ", mem.read(24))
            except (OSError, ValueError, struct.error):
                return None
            if first != head or pending != 0:  # an empty list points to itself
                return True
    return False


def _signal(pid: int, started: int, sig: int) -> bool:
    """Signal ``pid`` only if it is still the process that started at ``started``."""
    if start_ticks(pid) != started:
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _all_stopped(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not all(_task_stopped(pid, tid) for tid in _tasks(pid)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def kill_stub(pid: int, started: int, log: Callable[[str], None], bound_s: float = 10.0) -> bool:
    """SIGKILL the stub ``pid`` (which started at ``started``) at a moment it holds no lock it shares
    with the server; True when it is dead or already gone, False when that moment did not come
    within ``bound_s`` (it stays as it was: running, or stopped if someone else stopped it)."""
    stopped_by_other = is_stopped(pid) or _stop_pending(pid)
    deadline, pause = time.monotonic() + bound_s, 0.005
    while True:
        if start_ticks(pid) != started:
            return True
        if not stopped_by_other and not _signal(pid, started, signal.SIGSTOP):
            return True
        held = holds_robust_lock(pid) if _all_stopped(pid, 1.0) else True
        if held is None:
            log(f"neopp stub kill: {pid}: its locks cannot be read (no ptrace access); killing it anyway")
        if not held:
            _signal(pid, started, signal.SIGKILL)
            return True
        if stopped_by_other:
            log(f"neopp stub kill: {pid} was stopped holding a lock it shares with tritonserver; not killed")
            return False
        _signal(pid, started, signal.SIGCONT)
        if time.monotonic() + pause > deadline:
            log(f"neopp stub kill: {pid} held a lock it shares with tritonserver at every look for "
                f"{bound_s:.0f}s; not killed")
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.2)
