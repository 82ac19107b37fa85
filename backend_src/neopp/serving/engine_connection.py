"""One stub's connection to the engine's host (``engine_host``): a reader that submits and
cancels, a writer that sends each request's messages in order. Every request gets its last
message: one that cannot be built or sent (too large for the framing, failing to encode) is
replaced by an error naming no more than its kind.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from typing import Any, Protocol

from ..contract.statuses import INTERNAL
from ..sampling.sampler import StepEvent
from .wire import WireError, error_header, recv_message, send_message

log = logging.getLogger(__name__)
FRONT_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_")


class Host(Protocol):
    """What a connection needs of the engine's host (``engine_host.EngineHost``)."""

    stopping: threading.Event

    def accept(self, conn: Connection, job: int, header: dict[str, Any], blobs: list[bytes],
               fds: list[int]) -> None: ...

    def event_message(self, job: int, event: StepEvent, accepted: Any) -> tuple[dict[str, Any], list[bytes]]: ...

    def forget(self, conn: Connection) -> None: ...


def same_user(sock: socket.socket) -> bool:
    """Only a process of this server's user may send requests (the folder is 0700 too)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    except OSError:
        return False
    return int.from_bytes(creds[4:8], "little") == os.getuid()


class Connection:
    """One stub's connection: a reader that submits and cancels, a writer that sends the events."""

    def __init__(self, host: Host, sock: socket.socket) -> None:
        self.host, self.sock = host, sock
        self.kind, self.front = "plain", ""
        self._outbox: queue.Queue[tuple[dict[str, Any], list[bytes]] | None] = queue.Queue()
        self._cancelled: set[int] = set()
        self._closed = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._read, name="neopp-engine-read", daemon=True).start()
        threading.Thread(target=self._write, name="neopp-engine-write", daemon=True).start()

    def cancelled(self, job: int) -> bool:
        return self._closed.is_set() or job in self._cancelled or self.host.stopping.is_set()

    def send(self, header: dict[str, Any], blobs: list[bytes] | None = None) -> None:
        self._outbox.put((header, blobs or []))

    def refuse(self, job: int, status: str, reason: str, message: str) -> None:
        self.send(error_header(job, status, reason, message))

    def event(self, job: int, event: StepEvent, accepted: Any) -> None:
        """From the engine's thread: queued, turned into a message by the writer."""
        self._outbox.put((job, event, accepted))  # type: ignore[arg-type]

    def _read(self) -> None:
        try:
            header, _, fds = recv_message(self.sock)
            self._hello(header, fds)
            while True:
                header, blobs, fds = recv_message(self.sock)
                try:
                    self._handle(header, blobs, fds)
                finally:
                    for fd in fds:
                        os.close(fd)
        except (WireError, OSError, ValueError):
            pass
        finally:
            self.close()

    def _hello(self, header: dict[str, Any], fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        front, kind = header.get("front"), header.get("kind")
        if header.get("type") != "hello" or kind not in ("plain", "stream") or not isinstance(front, str) \
                or not 0 < len(front) <= 64 or not set(front) <= FRONT_NAME_CHARS:
            raise WireError("a connection starts with hello, naming its model and kind")
        self.kind, self.front = kind, front

    def _handle(self, header: dict[str, Any], blobs: list[bytes], fds: list[int]) -> None:
        job = header.get("job")
        if type(job) is not int:
            raise WireError("a message names its job")
        if header.get("type") == "cancel":
            self._cancelled.add(job)
        elif header.get("type") == "submit":
            self.host.accept(self, job, header, blobs, fds)
        else:
            raise WireError(f"unknown message {str(header.get('type'))[:32]!r}")

    def _write(self) -> None:
        while (item := self._outbox.get()) is not None:
            job = item[0] if len(item) == 3 else item[0].get("job")
            try:
                header, blobs = self._message(item)
                send_message(self.sock, header, blobs)
            except OSError:
                self.close()
            except Exception as exc:  # noqa: BLE001 - one bad event never stops the others, nor leaves its request
                self._undeliverable(job, item, exc)

    def _message(self, item: tuple) -> tuple[dict[str, Any], list[bytes]]:
        if len(item) == 3:  # an engine event
            job, event, accepted = item
            header, blobs = self.host.event_message(job, event, accepted)
            if header["type"] in ("final", "error"):
                self._cancelled.discard(job)
            return header, blobs
        return item

    def _undeliverable(self, job: Any, item: tuple, exc: Exception) -> None:
        """A message that could not be built or sent: its request ends with an internal error instead."""
        log.error("the answer to request %s could not be sent: %s: %s", job, type(exc).__name__, exc)
        if type(job) is not int or (len(item) == 2 and item[0].get("type") == "accepted"):
            return  # the request's last message follows
        last = len(item) == 2 or item[1].last
        if not last:
            return  # a step's event: the request's last one still comes
        self._cancelled.discard(job)
        try:
            send_message(self.sock, error_header(job, INTERNAL.status, INTERNAL.reason, INTERNAL.message(
                f"the answer could not be sent ({type(exc).__name__})")))
        except OSError:
            self.close()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()  # its requests are cancelled at their next step
        self._outbox.put(None)
        try:
            self.sock.close()
        except OSError:
            pass
        self.host.forget(self)
