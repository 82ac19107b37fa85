"""A stub's link to the stub that runs its mode's engine (``engine_host``): submit, events, cancel.

Every instance of a generation model, and every streamed twin, hands its requests to the mode's
one engine over this link: the request's tensors as the client sent them (the engine's stub
parses them, once), then one message back per step and a last one (the pixels, or the error).
A watcher thread polls each request's cancellation (its client left, the server stops) and tells
the engine, which drops it at its next step. When the engine's stub goes away, every request on
the link ends with UNAVAILABLE at once; the next request connects again.

No torch here: a stub that only forwards stays small (the tensors are read with ``wire``).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..contract.statuses import ENGINE_DOWN
from ..engine_beat import engines_folder
from .wire import WireError, failure_header, pack_tensors, recv_message, send_message

POLL_S = 0.05
CONNECT_WAIT_S = 30.0  # an engine's stub that is still loading gets this long to open its socket
DeliverFn = Callable[[dict[str, Any], list[bytes]], None]


def socket_path(owner_model: str, server_pid: int | None = None) -> Path:
    """Where ``owner_model``'s engine listens: a folder of this user and this tritonserver (the stubs'
    parent), so two servers on one host never share an engine."""
    return engines_folder(server_pid if server_pid is not None else os.getppid()) / f"{owner_model}.sock"


class EngineUnavailable(Exception):
    """No engine answers for this model (not loaded, not ready, or gone)."""


@dataclass
class _Job:
    deliver: DeliverFn
    cancelled: Callable[[], bool]
    told: bool = False
    done: bool = False  # its last message came: its request is no longer ours to ask about
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class EngineLink:
    """One connection of this stub to ``owner``'s engine, opened on first use and again after a loss."""

    owner: str
    front: str
    kind: str  # "plain" (answered once) or "stream" (answered every step)
    connect_wait_s: float = CONNECT_WAIT_S
    _sock: socket.socket | None = None
    _jobs: dict[int, _Job] = field(default_factory=dict)
    _numbers: Any = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _send_lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        threading.Thread(target=self._watch, name="neopp-link-watch", daemon=True).start()

    def submit(self, tensors: Sequence[Any], parameters: str | None, deliver: DeliverFn,
               cancelled: Callable[[], bool], final_only: bool) -> int:
        """Send one request; ``deliver(header, blobs)`` gets each message about it (on the link's
        reader thread: keep it short). Raises EngineUnavailable when no engine answers."""
        packed = pack_tensors(tensors)
        try:
            with self._lock:
                sock = self._connected()
                job = next(self._numbers)
                self._jobs[job] = _Job(deliver, cancelled)
            header = {"type": "submit", "job": job, "tensors": packed.specs, "parameters": parameters or "",
                      "final_only": final_only}
            try:
                with self._send_lock:
                    send_message(sock, header, packed.blobs, packed.fds)
            except OSError as exc:
                self._lost(sock, f"the engine of {self.owner} went away ({exc}); retry the request")
            return job
        finally:
            packed.close()

    def cancel(self, job: int) -> None:
        with self._lock:
            sock = self._sock
        if sock is None:
            return
        try:
            with self._send_lock:
                send_message(sock, {"type": "cancel", "job": job})
        except OSError:
            pass  # the connection is gone: so is the job

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    # ---- the connection ----------------------------------------------------------------------
    def _connected(self) -> socket.socket:
        """The open socket, or a new one (with the lock held); bounded wait for a loading engine."""
        if self._sock is not None:
            return self._sock
        path = socket_path(self.owner)
        deadline = time.monotonic() + self.connect_wait_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(path))
                with self._send_lock:
                    send_message(sock, {"type": "hello", "front": self.front, "kind": self.kind})
                break
            except OSError as exc:
                sock.close()
                if time.monotonic() > deadline or self._closed.is_set():
                    raise EngineUnavailable(f"{self.front}: its requests run on the engine of {self.owner}, which "
                                            f"does not answer ({exc.strerror or exc}); load {self.owner}") from None
                time.sleep(0.2)
        self._sock = sock
        threading.Thread(target=self._read, args=(sock,), name="neopp-link-read", daemon=True).start()
        return sock

    def _read(self, sock: socket.socket) -> None:
        try:
            while True:
                header, blobs, fds = recv_message(sock)
                for fd in fds:  # the engine sends none: never keep one
                    os.close(fd)
                self._dispatch(header, blobs)
        except (WireError, OSError, ValueError) as exc:
            self._lost(sock, f"the engine of {self.owner} went away ({exc}); retry the request")

    def _dispatch(self, header: dict[str, Any], blobs: list[bytes]) -> None:
        job = header.get("job")
        with self._lock:
            entry = self._jobs.get(job) if type(job) is int else None
            if entry is not None and header.get("type") in ("final", "error"):
                del self._jobs[job]
        if entry is None:
            return
        if header.get("type") in ("final", "error"):
            _finish(entry)
        entry.deliver(header, blobs)

    def _lost(self, sock: socket.socket, message: str) -> None:
        """The connection broke: every request on it ends now; the next one connects again."""
        with self._lock:
            if self._sock is sock:
                self._sock = None
            jobs, self._jobs = self._jobs, {}
        sock.close()
        for entry in jobs.values():
            _finish(entry)
            entry.deliver(failure_header(ENGINE_DOWN, message), [])

    def _watch(self) -> None:
        while not self._closed.wait(POLL_S):
            self._poll()

    def _poll(self) -> None:
        """One look at every request; its own frame, so no request stays referenced while the
        watcher waits (a request kept alive keeps its inputs in the stub's shared memory)."""
        with self._lock:
            waiting = [(job, e) for job, e in self._jobs.items() if not e.told]
        for job, entry in waiting:
            if _asked_gone(entry):
                entry.told = True
                self.cancel(job)


def _finish(entry: _Job) -> None:
    """No more probes of this request: once it is answered, Triton frees it (asking then crashes
    the server), so the last message marks it, under the lock the watcher probes under."""
    with entry.lock:
        entry.done = True


def _asked_gone(entry: _Job) -> bool:
    with entry.lock:
        if entry.done:
            return False
        try:
            return bool(entry.cancelled())
        except Exception:  # noqa: BLE001 - a probe that cannot answer has no client left
            return True
