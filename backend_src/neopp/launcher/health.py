"""Whether this server can serve now, from what the launcher itself knows: shared by the
supervisor (the server is up, starting, restarting), the stub watchdog (a model has an instance
that is dead, stopped or hung, or is being reloaded) and the HTTP door, which asks it for
readiness and for the answer to a request it cannot serve now (503 with Retry-After, not 500).

Nothing here comes from a client or from the text of an error: a client cannot make a replica
look unhealthy, and a broken replica leaves the router's pool while it recovers. A request sent
before the server was ready again may still fail on a stub that is gone (Triton answers it after
its 1 s health check): ``not_ready(since)`` says so, and the door answers it 503 too.

Liveness is separate (``alive_file``): the launcher touches a file while its supervisor loop
runs and the door's event loop answers, so a liveness probe never connects to the door and a
flood of idle connections on the public port cannot get a healthy pod restarted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..contract.statuses import RETRY_LATER


class ServerHealth:
    """The server's state and every model the launcher knows to be broken, with the reason."""

    def __init__(self, clock=time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._server: str | None = "tritonserver is starting"
        self._broken: dict[str, str] = {}
        self._reloads: dict[str, int] = {}  # per model: the times its stubs broke and were reloaded
        self._restart: str | None = None
        self._ready_at = 0.0  # when it last became ready

    @contextmanager
    def _changing(self) -> Iterator[None]:
        """A change under the lock; a change that makes it ready again is dated."""
        with self._lock:
            was_ready = self._reason() is None
            yield
            if not was_ready and self._reason() is None:
                self._ready_at = self._clock()

    def server_up(self) -> None:
        with self._changing():
            self._server, self._broken = None, {}

    def server_down(self, reason: str) -> None:
        with self._changing():
            self._server, self._broken = reason, {}

    def model_broken(self, model: str, reason: str) -> None:
        with self._changing():
            if model not in self._broken:
                self._reloads[model] = self._reloads.get(model, 0) + 1
            self._broken[model] = reason

    def reloads(self) -> dict[str, int]:
        """How often each model's stubs broke (and were reloaded) since the launcher started."""
        with self._lock:
            return dict(self._reloads)

    def model_serving(self, model: str) -> None:
        with self._changing():
            self._broken.pop(model, None)

    def _reason(self) -> str | None:
        if self._server is not None:
            return self._server
        return "; ".join(f"{m}: {why}" for m, why in sorted(self._broken.items())) or None

    def not_ready(self, since: float | None = None) -> str | None:
        """Why this server cannot serve now, or could not at some moment after ``since`` (a
        request sent then may have reached a stub that is gone); None: it can."""
        with self._lock:
            if (reason := self._reason()) is not None:
                return reason
            if since is not None and self._ready_at > since:
                return "it was recovering while this request ran"
            return None

    def model_unavailable(self, model: str) -> str | None:
        """Why ``model`` cannot be served now (None: as far as the launcher knows, it can)."""
        with self._lock:
            return self._server or (f"{model}: {self._broken[model]}" if model in self._broken else None)

    def request_restart(self, reason: str) -> None:
        """Ask the supervisor to restart tritonserver (within its restart rate)."""
        with self._lock:
            self._restart = self._restart or reason

    def take_restart(self) -> str | None:
        """The pending restart request, once."""
        with self._lock:
            reason, self._restart = self._restart, None
            return reason


def loop_answers(loop: asyncio.AbstractEventLoop | None, thread: threading.Thread | None, timeout_s: float) -> bool:
    """True when ``loop``, run by ``thread``, runs a no-op within ``timeout_s`` (it is not stuck)."""
    if loop is None or thread is None or not thread.is_alive():
        return False
    try:
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout_s)
    except (concurrent.futures.TimeoutError, RuntimeError):
        return False
    return True


def recovering(why: str) -> str:
    """How a refusal of what cannot be served now reads, on every port: the client should retry."""
    return RETRY_LATER.message(why)


def touch(path: Path) -> None:
    """Mark the launcher alive now (the file's modification time is what a probe reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a"):
        pass
    now = time.time()
    os.utime(path, (now, now))
