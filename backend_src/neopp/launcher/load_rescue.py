"""Rescue a model load that Triton 2.51's Python backend abandoned without saying so.

While a stub runs ``initialize``, the backend checks once a second that the stub's health
thread has set a flag in shared memory; on a machine so loaded that the thread misses one
beat, the backend judges the stub unhealthy and, before reporting the failure, waits for
the stub process to exit. The stub never does: it finishes ``initialize`` and waits for its
next message. The load, and with it the server's start, then hangs for good (seen under a
load average of 7 on 2 cores: the backend's thread sits in ``StubLauncher::WaitForStubProcess``
while the stub idles after our "loaded" line).

``StuckLoadWatch`` reads the server's log as it is relayed. Once every stub of a model has
logged the end of its ``initialize`` and Triton has neither loaded nor failed that model
``stuck_s`` later (normally it does within a second), the stubs are killed (``stub_kill``: never
while one holds a lock it shares with the server). The backend's
wait then ends, the load fails with Triton's own "not healthy" message, and the server goes
on; the launcher loads the model again once the server is up.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

from ..procs import model_stubs, start_ticks
from .poller import Poller
from .stub_kill import kill_stub

# Triton's first line of a load, and our own last line of initialize (the generation models' and the
# prompt encoder's "loaded" in the owner instance, "hands its requests" in each other instance, the session
# model's settings, neopp_t2i's "encoder"); Triton's last line of a load. Only a load begun and not settled
# counts: the log relay may deliver a model's "loaded" after Triton's "successfully loaded".
LOADING = re.compile(r'"loading: (\w+):\d+"')
INIT_DONE = re.compile(r'(?:engine_start|triton_model|session_model|prompt_encoder_model|t2i_model)\.py:\d+\] '
                       r'"(\w+)(?: \(\w+\))?: (?:loaded |hands its requests |sessions max=|encoder )')
SETTLED = re.compile(r"(?:successfully loaded|failed to load) '(\w+)'")


class StuckLoadWatch:
    """Watches one server's log; stops the stubs of a model whose finished load Triton never took."""

    def __init__(self, server_pid: int, log: Callable[[str], None], stuck_s: float = 30.0, poll_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic,
                 stubs: Callable[[int, str], list[int]] = model_stubs) -> None:
        self.server_pid, self._log, self.stuck_s = server_pid, log, float(stuck_s)
        self._clock, self._stubs = clock, stubs
        self._loading: set[str] = set()
        self._done: dict[str, tuple[int, float]] = {}  # model -> (instances that finished, when the last did)
        self._lock = threading.Lock()
        self.rescued: list[str] = []
        self._poller = Poller("neopp-load-rescue", poll_s, self.check,
                              lambda exc: log(f"neopp load rescue: check failed: {type(exc).__name__}: {exc}"))

    def start(self) -> StuckLoadWatch:
        self._poller.start()
        return self

    def close(self) -> None:
        self._poller.stop(timeout_s=5)

    def feed(self, line: bytes) -> None:
        """One line of the server's output (called by the log relay)."""
        text = line.decode("utf-8", "replace")
        with self._lock:
            if m := LOADING.search(text):
                self._loading.add(m.group(1))
                self._done.pop(m.group(1), None)
            elif (m := INIT_DONE.search(text)) and m.group(1) in self._loading:
                count, _ = self._done.get(m.group(1), (0, 0.0))
                self._done[m.group(1)] = (count + 1, self._clock())
            elif m := SETTLED.search(text):
                self._loading.discard(m.group(1))
                self._done.pop(m.group(1), None)

    def check(self) -> list[str]:
        """Stop the stubs of every stuck model now; returns those models."""
        now = self._clock()
        with self._lock:
            waiting = [(model, count) for model, (count, when) in self._done.items() if now - when > self.stuck_s]
        out = []
        for model, count in waiting:
            stubs = self._stubs(self.server_pid, model)
            if not stubs or len(stubs) > count:  # gone already, or an instance still initializing
                continue
            self._log(f"W neopp load rescue: {model}: initialize ended {self.stuck_s:.0f}+ s ago on all {count} "
                      "instance(s) but Triton never took it (its Python backend judged a stub unhealthy under "
                      "load and waits for it to exit); stopping its stubs so that the load fails and is retried")
            for pid in stubs:
                started = start_ticks(pid)
                if started is not None:
                    kill_stub(pid, started, self._log)
            with self._lock:
                self._done.pop(model, None)
                self._loading.discard(model)
            out.append(model)
        self.rescued += out
        return out
