"""What an attacker sends a server's HTTP door and gRPC port, each attack on threads of its own.

Every attack runs until ``stop()`` and keeps counts of what it sent and what came back, so a soak
can say what was tried. None of them needs the server's cooperation or a key:

* ``IdleConnections``: connections that never send a byte, reopened as soon as the server closes one;
* ``TrickledUploads``: bodies that declare 128 MiB and send a byte every 10 s;
* ``LargeJson``: JSON objects of 450,000 keys (about 9 MB) posted one after another;
* ``PlantedUnhealthy``: requests whose input name is the text Triton prints for a dead stub;
* ``SessionFlood``: sessions opened and never ended, as many as the server takes;
* ``GrpcAbuse``: gRPC calls of no message, of bytes that do not parse, of 70,000 empty fields, and
  streams that send and never read their answers.

Every wait is bounded and every socket is closed at ``stop()``.
"""

from __future__ import annotations

import http.client
import itertools
import json
import select
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
from tritonclient.grpc import service_pb2 as pb

from neopp.ports import LOOPBACK


class Attack(ABC):
    """Threads that run ``_run`` until stopped; ``counts`` says what happened (thread-safe)."""

    name = "attack"
    threads = 1

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def start(self) -> Attack:
        self._workers = [threading.Thread(target=self._guarded, args=(i,), name=f"{self.name}-{i}", daemon=True)
                         for i in range(self.threads)]
        for worker in self._workers:
            worker.start()
        return self

    def stop(self, timeout: float = 30.0) -> dict[str, int]:
        self._stop.set()
        deadline = time.monotonic() + timeout
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        self._close()
        return dict(self.counts)

    def _post(self, port: int, path: str, body: bytes, timeout: float, source: str | None = None) -> int | None:
        """One JSON POST on a fresh connection (from address ``source``); its status (or the
        connection's failure) is counted and returned."""
        conn = http.client.HTTPConnection(LOOPBACK, port, timeout=timeout,
                                          source_address=(source, 0) if source else None)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            answer = conn.getresponse()
            answer.read()
            self.count(f"answered {answer.status}")
            return answer.status
        except OSError as exc:
            self.count(f"connection error: {type(exc).__name__}")
            return None
        finally:
            conn.close()

    def _guarded(self, index: int) -> None:
        try:
            self._run(index)
        except Exception as exc:  # noqa: BLE001 - an attack that fails is reported, not raised
            self.count(f"crashed: {type(exc).__name__}")

    @abstractmethod
    def _run(self, index: int) -> None:
        """What each of the attack's ``threads`` does until stopped: every attack defines it."""

    def _close(self) -> None:  # noqa: B027 - optional: only attacks that hold connections release them
        """Release what the threads left open (after they stopped)."""


def _connect(port: int, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection((LOOPBACK, port), timeout=timeout)


def _status_of(data: bytes) -> str:
    """``HTTP/1.1 408 ...`` -> ``408``; anything else -> ``closed``."""
    parts = data.split(b" ", 2)
    return parts[1].decode(errors="replace") if len(parts) > 1 and data.startswith(b"HTTP/") else "closed"


class IdleConnections(Attack):
    """``n`` connections to the door that never send a request; one the server closes is reopened."""

    name = "idle-connections"

    def __init__(self, port: int, n: int = 256) -> None:
        super().__init__()
        self.port, self.n = port, n
        self._socks: list[socket.socket] = []

    def _run(self, index: int) -> None:
        while not self._stop.is_set():
            while len(self._socks) < self.n and not self._stop.is_set():
                try:
                    self._socks.append(_connect(self.port))
                    self.count("opened")
                except OSError:
                    self.count("connect failed")
                    break
            readable, _, _ = select.select(self._socks, [], [], 0.5) if self._socks else ([], [], [])
            for sock in readable:  # the server answered or closed it: it is no longer idle
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                self.count(f"closed by the server ({_status_of(data)})")
                sock.close()
                self._socks.remove(sock)
            if not self._socks:
                self._stop.wait(0.5)

    def _close(self) -> None:
        for sock in self._socks:
            sock.close()
        self._socks.clear()


class TrickledUploads(Attack):
    """``threads`` uploads that declare ``declared`` bytes and send one every ``every_s`` seconds;
    the body declares a short JSON header and a large binary part (the binary extension), the only
    shape in which a large body is taken at all."""

    name = "trickled-uploads"
    threads = 3

    def __init__(self, port: int, path: str = "/v2/models/neopp_dense/infer", declared: int = 128 << 20,
                 every_s: float = 10.0) -> None:
        super().__init__()
        self.port, self.path, self.declared, self.every_s = port, path, declared, every_s

    def _run(self, index: int) -> None:
        head = (f"POST {self.path} HTTP/1.1\r\nHost: {LOOPBACK}\r\nContent-Type: application/json\r\n"
                f"Inference-Header-Content-Length: 64\r\nContent-Length: {self.declared}\r\n\r\n").encode()
        while not self._stop.is_set():
            try:
                with _connect(self.port) as sock:
                    sock.sendall(head + b"{")
                    self.count("started")
                    while not self._stop.is_set():
                        readable, _, _ = select.select([sock], [], [], self.every_s)
                        if readable:  # an answer (or a close) before the body ended
                            self.count(f"answered {_status_of(sock.recv(4096))}")
                            break
                        sock.sendall(b" ")
                        self.count("bytes trickled")
            except OSError as exc:
                self.count(f"connection error: {type(exc).__name__}")
            self._stop.wait(1.0)  # then the next upload: a trickler, not a connection flood


class LargeJson(Attack):
    """``threads`` clients posting a JSON object of ``keys`` keys, one after another."""

    name = "large-json"
    threads = 3

    def __init__(self, port: int, path: str = "/v2/models/neopp_dense/infer", keys: int = 450_000,
                 pause_s: float = 0.2) -> None:
        super().__init__()
        self.port, self.path, self.pause_s = port, path, pause_s
        self.body = ("{" + ",".join(f'"key{i:07d}":{i}' for i in range(keys)) + "}").encode()  # ~9 MB

    def _run(self, index: int) -> None:
        while not self._stop.is_set():
            self._post(self.port, self.path, self.body, timeout=60)
            self._stop.wait(self.pause_s)


def unhealthy_text(instance: str) -> str:
    """What Triton 2.51 says when a Python stub is gone (the door once acted on it)."""
    return f"Stub process '{instance}' is not healthy"


class PlantedUnhealthy(Attack):
    """Every ``every_s`` seconds, a request to ``model`` whose input is named after an instance's
    'not healthy' text; the instances taken in turn."""

    name = "planted-unhealthy"

    def __init__(self, port: int, instances: list[tuple[str, str]], every_s: float = 2.0) -> None:
        """``instances``: (model to send to, instance named in the text)."""
        super().__init__()
        self.port, self.instances, self.every_s = port, instances, every_s

    def _run(self, index: int) -> None:
        turn = 0
        while not self._stop.wait(self.every_s):
            model, instance = self.instances[turn % len(self.instances)]
            turn += 1
            body = json.dumps({"inputs": [{"name": unhealthy_text(instance), "shape": [1], "datatype": "INT64",
                                           "data": [1]}]}).encode()
            self._post(self.port, f"/v2/models/{model}/infer", body, timeout=30)


class SessionFlood(Attack):
    """Sessions opened and never ended, from ``threads`` clients: ``open_session(sequence_id)`` sends
    one first turn and raises when it is refused; a refusal waits ``pause_s`` before the next try."""

    name = "session-flood"

    def __init__(self, open_session: Callable[[int], Any], first_id: int = 900_000_000, pause_s: float = 1.0,
                 threads: int = 2) -> None:
        super().__init__()
        self.open_session, self.pause_s, self.threads = open_session, pause_s, threads
        self._ids = itertools.count(first_id + 1)

    def _run(self, index: int) -> None:
        while not self._stop.is_set():
            try:
                self.open_session(next(self._ids))
                self.count("opened")
            except Exception as exc:  # noqa: BLE001 - a refusal is the expected answer once the table is full
                self.count(f"refused: {_refusal(exc)}")
                self._stop.wait(self.pause_s)


def _refusal(exc: Exception) -> str:
    status = getattr(exc, "status", lambda: None)()
    message = getattr(exc, "message", lambda: str(exc))() or ""
    return f"{status} {message[:60]}"


class ClientFlood(Attack):
    """One client (address ``source``) with ``threads`` parallel ``/v1`` requests of ``n`` images
    each, sent again as soon as answered: a burst that, without a per-client bound and turns
    between clients, made another client wait most of a minute. A refusal waits ``pause_s``."""

    name = "client-flood"
    threads = 40

    def __init__(self, port: int, prompt: str, source: str = "127.0.0.3", n: int = 4, size: str = "320x320",
                 pause_s: float = 0.2) -> None:
        super().__init__()
        self.port, self.source, self.pause_s = port, source, pause_s
        self.body = json.dumps({"prompt": prompt, "n": n, "size": size, "stream": True}).encode()

    def _run(self, index: int) -> None:
        while not self._stop.is_set():
            if self._post(self.port, "/v1/images/generations", self.body, timeout=300, source=self.source) != 200:
                self._stop.wait(self.pause_s)


class GrpcAbuse(Attack):
    """Calls the gRPC port must answer, each with a deadline so that one left unanswered is counted
    ("deadline"), and streams whose client sends and never reads, cancelled after ``hold_s``."""

    name = "grpc-abuse"
    threads = 2
    SERVICE = "/inference.GRPCInferenceService/"

    def __init__(self, target: str, hold_s: float = 10.0, deadline_s: float = 60.0,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        """``metadata``: headers of every call (an API key, to reach past the key check)."""
        super().__init__()
        self.target, self.hold_s, self.deadline_s, self.metadata = target, hold_s, deadline_s, metadata
        many = pb.ModelInferRequest(model_name="neopp_dense")
        for _ in range(70_000):
            many.outputs.add()
        self.calls = {"no message": [], "garbage": [b"\xff\xff\xff"], "70,000 fields": [many.SerializeToString()]}

    def _run(self, index: int) -> None:
        with grpc.insecure_channel(self.target) as channel:
            while not self._stop.is_set():
                if index == 0:
                    for what, messages in self.calls.items():
                        self._call(channel, "ModelInfer", what, messages)
                    self._stop.wait(0.5)
                else:
                    self._unread_stream(channel)

    def _call(self, channel: grpc.Channel, method: str, what: str, messages: list[bytes]) -> None:
        call = channel.stream_stream(self.SERVICE + method, request_serializer=None, response_deserializer=None)
        try:
            list(call(iter(messages), timeout=self.deadline_s, metadata=self.metadata))
            self.count(f"{what}: OK")
        except grpc.RpcError as exc:
            code = exc.code()
            self.count(f"{what}: {'deadline' if code == grpc.StatusCode.DEADLINE_EXCEEDED else code.name}")

    def _unread_stream(self, channel: grpc.Channel) -> None:
        sent = [0]

        def requests() -> Any:
            for _ in range(64_000):
                sent[0] += 1
                yield pb.ModelInferRequest(model_name="no_such_model", id="x" * 4000).SerializeToString()

        call = channel.stream_stream(self.SERVICE + "ModelStreamInfer", request_serializer=None,
                                     response_deserializer=None)(requests(), metadata=self.metadata)
        self._stop.wait(self.hold_s)
        call.cancel()
        self.count("unread streams")
        self.count("unread stream requests sent", sent[0])
