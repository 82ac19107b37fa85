"""A test session's shared tritonserver kept up: started again on the same ports when it dies.

The launcher does this for a service (``neopp.launcher.supervisor``); a test suite runs its
shared server without the launcher, so one abort (Triton 2.51 aborts when a stub dies holding a
lock it shares with the server, or runs again after Triton gave up on it) used to fail every
test after it. Here the test that was running when the server died fails; the ones after it
find the server back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from neopp.launcher.tritonserver import TritonServer


class KeptServer:
    """Watches ``holder.server`` (a started ``TritonServer``); when it exits, stops what is left of
    it, starts ``successor()`` and puts the new one in ``holder.server``."""

    def __init__(self, holder: Any, ready_timeout_s: float = 600.0, note: Callable[[str], None] = print) -> None:
        self.holder, self.ready_timeout_s, self.note = holder, ready_timeout_s, note
        self.restarts: list[int] = []  # exit codes of the servers that died
        self.servers: list[TritonServer] = [holder.server]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kept-tritonserver", daemon=True)

    def start(self) -> KeptServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.ready_timeout_s + 60)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            server = self.holder.server
            code = server.process.poll()
            if code is None:
                continue
            self.note(f"tritonserver {server.process.pid} exited with code {code}; starting it again")
            server.stop(timeout=30)
            new = server.successor().start()
            self.servers.append(new)
            self.restarts.append(code)
            try:
                new.wait_ready(timeout=self.ready_timeout_s)
            except Exception as exc:  # noqa: BLE001 - reported; the tests after it fail on their own
                self.note(f"the new tritonserver did not come up: {exc}")
                return
            self.holder.server = new
