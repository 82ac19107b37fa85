"""The socket an owner stub serves its model's other stubs on, and the heartbeat beside it.

A model whose instances share one copy of the weights (a generation mode's engine, the prompt
encoder's language tower) loads them in its first instance, the **owner**, which listens on a
Unix socket (``engine_link.socket_path``) of this user and this tritonserver; every instance,
the owner's own included, hands its requests over that socket (``engine_link``). The owner also
rewrites the heartbeat (``neopp.engine_beat``) the launcher reads: once the owner's work loop can
serve no more, the model is marked not ready and replaced.
"""

from __future__ import annotations

import os
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

from ..contract.statuses import INTERNAL
from ..engine_beat import BEAT_S, beat_path, write_beat
from ..errors import EngineDown, GenerationCancelled
from .engine_connection import Connection, same_user
from .engine_link import socket_path
from .wire import WireError

T = TypeVar("T")


class SocketHost(ABC):
    """Listening, accepting and beating; what a request becomes is the subclass's ``accept``.
    ``close`` stops listening."""

    def __init__(self, owner: str, stopping: threading.Event, error_log: Any) -> None:
        self.owner, self.stopping, self.error_log = owner, stopping, error_log
        self._connections: set[Connection] = set()
        self._closed = threading.Event()
        self.path = socket_path(owner)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o700)
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()  # left by a stub of this model that died: its server (the folder) is ours
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._inode = self.path.stat().st_ino  # a reload's new owner binds the same path before this one closes
        self._listener.listen(64)
        self.beat_path, self._told_failure = beat_path(owner, os.getppid()), False

    def start(self) -> None:
        """Beat once, then accept connections and keep beating (after the subclass is set up)."""
        self._beat()
        threading.Thread(target=self._accept_loop, name="neopp-engine-accept", daemon=True).start()
        threading.Thread(target=self._beat_loop, name="neopp-engine-beat", daemon=True).start()

    def failure(self) -> str | None:
        """Why the owner's work loop can serve no more, or None."""
        return None

    @abstractmethod
    def accept(self, conn: Connection, job: int, header: dict[str, Any], blobs: list[bytes], fds: list[int]) -> None:
        """Take one submitted request: queue it, or refuse it on ``conn``."""

    @abstractmethod
    def answer(self, exc: BaseException) -> tuple[str, str, str]:
        """(Triton status, metric reason, message) of a request's error."""

    def admit(self, conn: Connection, job: int, parse: Callable[[], T], work: str) -> T | None:
        """``parse()``'s request, or None once it is refused on ``conn``: the server stopping, the
        loop down, or ``parse`` refusing it. ``work``: what a cancelled request did not get to."""
        try:
            if self.stopping.is_set():
                raise GenerationCancelled(f"request cancelled before {work}")
            if (failure := self.failure()) is not None:
                raise EngineDown(failure)
            return parse()
        except WireError as exc:
            conn.refuse(job, INTERNAL.status, INTERNAL.reason, INTERNAL.message(f"malformed request: {exc}"))
        except Exception as exc:  # noqa: BLE001 - every refusal is answered; the loop stays usable
            conn.refuse(job, *self.answer(exc))
        return None

    def _beat_loop(self) -> None:
        while not self._closed.wait(BEAT_S):
            self._beat()

    def _beat(self) -> None:
        """Publish whether the loop can serve, while the socket is still this host's (a reload's
        new owner beats at the same path)."""
        failure = self.failure()
        if failure is not None and not self._told_failure:
            self._told_failure = True
            self.error_log(f"{self.owner}: engine out of service: {failure}; refusing requests until replaced")
        try:
            if self.path.stat().st_ino == self._inode:
                write_beat(self.beat_path, failure)
        except OSError:
            pass

    def close(self) -> None:
        """Stop listening. With its loop down, drop every connection too (it holds no request):
        a linked stub then connects to the owner that replaces this one (a reload binds the same
        path first) instead of being refused by this one until it exits."""
        self._closed.set()
        if self.failure() is not None:
            for conn in list(self._connections):
                conn.close()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        try:
            if self.path.stat().st_ino == self._inode:  # still ours, not the socket of a reload's new owner
                self.path.unlink()
                self.beat_path.unlink(missing_ok=True)
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            if not same_user(sock):
                sock.close()
                continue
            conn = Connection(self, sock)
            self._connections.add(conn)
            conn.start()

    def forget(self, conn: Connection) -> None:
        self._connections.discard(conn)
