"""Legitimate mixed traffic for a soak: plain gRPC, gRPC streams, the OpenAI ``/v1`` route, sessions.

Each kind sends a seeded request (a session: two turns) whose answer must be the reference bytes
taken one request at a time before the load. Every request ends as one ``Outcome`` with a label:

* ``ok`` / ``wrong``: answered, with the reference bytes or not;
* ``refused``: told to come back (HTTP 429 or 503 with ``Retry-After``; gRPC UNAVAILABLE);
* ``refused-without-retry-after``: HTTP 429 or 503 without the header;
* ``client-error`` (another 4xx, or a gRPC status that blames the request), ``server-error`` (5xx,
  gRPC INTERNAL or UNKNOWN), ``transport`` (no answer: a refused or reset connection, a timeout).

``OpenLoop`` sends jobs at a fixed rate whatever the answers (what a crowd of clients does);
``closed_loop_rate`` measures the rate the server completes.
"""

from __future__ import annotations

import base64
import http.client
import itertools
import json
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from neopp.contract.statuses import status_of_message
from neopp.ports import LOOPBACK
from testing.fuzz import Inputs
from testing.loadgen import grpc_inputs, valid_inputs, with_token

KINDS = ("grpc", "stream", "v1", "session")
TIMEOUT_S = 120.0
V1_USERS = 8  # the /v1 jobs come from this many client addresses (127.0.1.1 ...), as many people would
RETRY_LATER = ("Exceeds maximum queue size", "session limit reached")
CLIENT_FAULTS = ("INVALID_ARGUMENT", "NOT_FOUND", "PERMISSION_DENIED", "UNAUTHENTICATED", "OUT_OF_RANGE",
                 "FAILED_PRECONDITION", "ALREADY_EXISTS", "UNIMPLEMENTED", "RESOURCE_EXHAUSTED")


@dataclass(frozen=True)
class Outcome:
    kind: str
    started: float  # time.monotonic() when it was sent
    seconds: float
    label: str
    detail: str = ""


def grpc_label(exc: InferenceServerException) -> tuple[str, str]:
    """(label, detail) of a gRPC error."""
    status, message = str(exc.status() or "").removeprefix("StatusCode."), exc.message() or ""
    if not status:  # a stream's error: text alone, read as a BLS model reads a called model's
        status = {"INVALID_ARG": "INVALID_ARGUMENT"}.get(status_of_message(message), status_of_message(message))
    detail = f"gRPC {status}: {message[:100]}"
    if status == "UNAVAILABLE" and not any(m in message for m in ("failed to connect", "Socket closed")):
        return "refused", detail
    if status in CLIENT_FAULTS:
        return "client-error", detail
    if status in ("INTERNAL", "UNKNOWN"):
        return "server-error", detail
    return "transport", detail


def http_label(status: int, headers: Any, body: bytes) -> tuple[str, str]:
    """(label, detail) of an HTTP answer other than 200."""
    detail = f"HTTP {status}: {body[:100].decode(errors='replace')}"
    if status in (429, 503):
        return ("refused" if headers.get("Retry-After") else "refused-without-retry-after"), detail
    return ("client-error" if status < 500 else "server-error"), detail


@dataclass
class Workload:
    """The requests of each kind; ``references`` takes their expected bytes one at a time."""

    grpc_url: str
    http_port: int
    cond: np.ndarray
    uncond: np.ndarray
    offsets: tuple[int, int]
    prompt: str
    size: int = 64
    steps: int = 4
    seeds: tuple[int, ...] = (11, 12, 13)
    expected: dict[tuple[str, int], list[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._ids = itertools.count(700_000_000)
        self._users = itertools.count()
        self._local = threading.local()

    def references(self) -> None:
        for kind in KINDS:
            for seed in self.seeds:
                self.expected[kind, seed] = list(self._turns(kind, seed, [0.0]))

    def run(self, kind: str, seed: int) -> list[Outcome]:
        """One job; a session's two turns are two outcomes (the second only if the first answered)."""
        out: list[Outcome] = []
        want = self.expected.get((kind, seed), [])
        sent = [time.monotonic()]  # when the current request went out (the turns update it)
        try:
            for turn, got in enumerate(self._turns(kind, seed, sent)):
                label = "ok" if turn < len(want) and got == want[turn] else "wrong"
                out.append(Outcome(kind, sent[0], time.monotonic() - sent[0], label))
        except Exception as exc:  # noqa: BLE001 - every failure is an outcome, the load goes on
            out.append(Outcome(kind, sent[0], time.monotonic() - sent[0], *self._label(exc)))
        return out

    # ------------------------------------------------------------------ one job of each kind

    def _turns(self, kind: str, seed: int, sent: list[float]) -> Iterator[bytes]:
        """The images of one job, in order; ``sent[0]`` is set as each request goes out."""
        sent[0] = time.monotonic()
        if kind == "grpc":
            yield bytes(self.client().infer("neopp_dense", grpc_inputs(self._inputs(seed)),
                                           client_timeout=TIMEOUT_S).as_numpy("IMAGE")[0])
        elif kind == "stream":
            yield self._stream(seed)
        elif kind == "v1":
            yield self._v1(seed)
        else:
            sid, result = next(self._ids), None
            for turn in range(2):
                sent[0] = time.monotonic()
                inputs = self._inputs(seed if turn == 0 else None)
                inputs = inputs if result is None else with_token(inputs, result)
                result = self.client().infer("neopp_session", grpc_inputs(inputs), sequence_id=sid,
                                            sequence_start=turn == 0, sequence_end=turn == 1,
                                            client_timeout=TIMEOUT_S)
                yield bytes(result.as_numpy("IMAGE")[0])

    def _inputs(self, seed: int | None) -> Inputs:
        return valid_inputs(self.cond, self.uncond, self.offsets, seed, size=(self.size, self.size), steps=self.steps)

    def client(self) -> grpcclient.InferenceServerClient:
        """This thread's gRPC client."""
        if not hasattr(self._local, "client"):
            self._local.client = grpcclient.InferenceServerClient(self.grpc_url)
        return self._local.client

    def _stream(self, seed: int) -> bytes:
        answers: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            client.start_stream(callback=lambda result, error: answers.put((result, error)))
            client.async_stream_infer("neopp_dense_stream", grpc_inputs(self._inputs(seed)))
            deadline = time.monotonic() + TIMEOUT_S
            while True:
                result, error = answers.get(timeout=max(0.1, deadline - time.monotonic()))
                if error is not None:
                    raise error
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    return bytes(result.as_numpy("IMAGE")[0])
        finally:
            client.stop_stream()
            client.close()

    def _v1(self, seed: int) -> bytes:
        body = json.dumps({"model": "neopp_dense", "prompt": self.prompt, "size": f"{self.size}x{self.size}",
                           "seed": seed, "num_inference_steps": self.steps, "output_format": "png"}).encode()
        user = f"127.0.1.{next(self._users) % V1_USERS + 1}"  # the door tells clients apart by address
        conn = http.client.HTTPConnection(LOOPBACK, self.http_port, timeout=TIMEOUT_S, source_address=(user, 0))
        try:
            conn.request("POST", "/v1/images/generations", body, {"Content-Type": "application/json"})
            answer = conn.getresponse()
            data = answer.read()
        finally:
            conn.close()
        if answer.status != 200:
            raise HttpRefusal(answer.status, answer.headers, data)
        return base64.b64decode(json.loads(data)["data"][0]["b64_json"])

    @staticmethod
    def _label(exc: Exception) -> tuple[str, str]:
        if isinstance(exc, InferenceServerException):
            return grpc_label(exc)
        if isinstance(exc, HttpRefusal):
            return http_label(exc.status, exc.headers, exc.body)
        return "transport", f"{type(exc).__name__}: {str(exc)[:100]}"


class HttpRefusal(Exception):
    def __init__(self, status: int, headers: Any, body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.headers, self.body = status, headers, body


def closed_loop_rate(workload: Workload, clients: int, seconds: float) -> tuple[float, Counter[str]]:
    """Jobs per second the server completes correctly with ``clients`` sending back to back, and the
    labels of every outcome."""
    outcomes: list[list[Outcome]] = []
    deadline = time.monotonic() + seconds

    def client(index: int) -> None:
        for i in itertools.count(index):
            if time.monotonic() >= deadline:
                return
            outcomes.append(workload.run(KINDS[i % len(KINDS)], workload.seeds[i % len(workload.seeds)]))

    started = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    done = sum(1 for job in outcomes if job and all(o.label == "ok" for o in job))
    return done / (time.monotonic() - started), Counter(o.label for job in outcomes for o in job)


@dataclass
class OpenLoop:
    """Jobs at ``rate`` per second for a bounded time, at most ``max_in_flight`` at once (a job due
    while that many run is counted as not sent)."""

    workload: Workload
    rate: float
    max_in_flight: int = 64
    outcomes: list[Outcome] = field(default_factory=list)
    not_sent: int = 0

    def run(self, seconds: float, on_tick: Callable[[float], None] | None = None) -> None:
        slots = threading.BoundedSemaphore(self.max_in_flight)
        lock = threading.Lock()

        def job(kind: str, seed: int) -> None:
            try:
                got = self.workload.run(kind, seed)
                with lock:
                    self.outcomes.extend(got)
            finally:
                slots.release()

        started = time.monotonic()
        with ThreadPoolExecutor(self.max_in_flight) as pool:
            for i in itertools.count():
                due = started + i / self.rate
                if due >= started + seconds:
                    break
                time.sleep(max(0.0, due - time.monotonic()))
                if on_tick is not None:
                    on_tick(time.monotonic() - started)
                if not slots.acquire(blocking=False):
                    self.not_sent += 1
                    continue
                seeds = self.workload.seeds
                pool.submit(job, KINDS[i % len(KINDS)], seeds[(i // len(KINDS)) % len(seeds)])
