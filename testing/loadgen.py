"""Concurrent valid load against a running server, with every image checked byte for byte.

The expected bytes come from one sequential pass before the load (the references); under load
each client (gRPC or HTTP, alternately) repeats the same requests, direct and in sessions, and
any error or any differing byte is counted. Resident memory of the server and every process
below it (Python stubs, rank workers) is read after the warm-up and after the run.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from neopp.procs import descendants, rss_bytes
from testing.fuzz import Inputs, tensor, text


def grpc_inputs(inputs: Inputs) -> list[grpcclient.InferInput]:
    out = []
    for name, (arr, datatype) in inputs.items():
        t = grpcclient.InferInput(name, list(arr.shape), datatype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def http_inputs(inputs: Inputs) -> list[httpclient.InferInput]:
    out = []
    for name, (arr, datatype) in inputs.items():
        t = httpclient.InferInput(name, list(arr.shape), datatype)
        t.set_data_from_numpy(arr, binary_data=True)
        out.append(t)
    return out


def infer(client: Any, model: str, inputs: Inputs, timeout: float = 120.0, **sequence: Any) -> Any:
    """One request over whichever protocol ``client`` speaks."""
    if isinstance(client, grpcclient.InferenceServerClient):
        return client.infer(model, grpc_inputs(inputs), client_timeout=timeout, **sequence)
    return client.infer(model, http_inputs(inputs), timeout=int(timeout * 1e6), **sequence)


def image_bytes(result: Any) -> bytes:
    return bytes(result.as_numpy("IMAGE")[0])


def with_token(inputs: Inputs, result: Any) -> Inputs:
    """A session's next turn: ``inputs`` plus the SESSION_TOKEN its last answer carried."""
    return {**inputs, "SESSION_TOKEN": (np.array([result.as_numpy("SESSION_TOKEN")[0]], np.object_), "BYTES")}


def valid_inputs(cond: np.ndarray, uncond: np.ndarray, offsets: tuple[int, int], seed: int | None,
                 size: tuple[int, int] = (32, 32), steps: int = 2) -> Inputs:
    """A small guided PNG request; KV arrays are float32 sent as BF16."""
    inputs = {"COND_KV": (cond, "BF16"), "UNCOND_KV": (uncond, "BF16"),
              "INDEX_OFFSET_COND": tensor(np.array([offsets[0]], np.int64)),
              "INDEX_OFFSET_UNCOND": tensor(np.array([offsets[1]], np.int64)),
              "SIZE": tensor(np.array(size, np.int64)), "STEPS": tensor(np.array([steps], np.int64)),
              "OUTPUT_FORMAT": text(b"png")}
    if seed is not None:
        inputs["SEED"] = tensor(np.array([seed], np.int64))
    return inputs


@dataclass(frozen=True)
class LoadSpec:
    """What the clients send: direct requests to ``models``, sessions of ``session_turns`` turns."""

    cond: np.ndarray
    uncond: np.ndarray
    offsets: tuple[int, int]
    models: tuple[str, ...] = ("neopp_dense", "neopp_dense_fp8", "neopp_moe", "neopp_dense_8steps")
    session_model: str | None = "neopp_session"
    seeds: tuple[int, ...] = (11, 12, 13)
    session_turns: int = 3
    clients: int = 8


@dataclass
class LoadReport:
    requests: int = 0
    sessions: int = 0
    errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    per_model: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    rss_warm: int = 0
    rss_after: int = 0

    @property
    def rss_change(self) -> float:
        return (self.rss_after - self.rss_warm) / max(self.rss_warm, 1)

    def summary(self) -> str:
        return (f"{self.requests} requests ({self.sessions} sessions) in {self.seconds:.1f}s, "
                f"{len(self.errors)} errors, {len(self.mismatches)} wrong images; per model {self.per_model}; "
                f"RSS after warm-up {self.rss_warm / 2**20:.1f} MiB, after the run {self.rss_after / 2**20:.1f} MiB "
                f"({self.rss_change:+.1%})")


class LoadRun:
    """References first, then ``spec.clients`` threads for a bounded time (see module doc)."""

    def __init__(self, spec: LoadSpec, grpc_url: str, http_url: str, server_pid: int) -> None:
        self.spec, self.grpc_url, self.http_url, self.server_pid = spec, grpc_url, http_url, server_pid
        self.expected: dict[tuple[str, int], bytes] = {}
        self.expected_sessions: dict[int, list[bytes]] = {}
        self._ids = itertools.count(1_000_000)
        self._lock = threading.Lock()

    def server_rss(self) -> int:
        return rss_bytes([self.server_pid, *descendants(self.server_pid)])

    def _client(self, index: int) -> Any:
        if index % 2:
            return httpclient.InferenceServerClient(self.http_url, network_timeout=300.0, connection_timeout=30.0)
        return grpcclient.InferenceServerClient(self.grpc_url)

    def _request(self, seed: int | None) -> Inputs:
        s = self.spec
        return valid_inputs(s.cond, s.uncond, s.offsets, seed)

    def session_images(self, client: Any, seed: int) -> list[bytes]:
        """One session: a seeded first turn, then turns that continue its stream; ended at the last."""
        with self._lock:
            sid = next(self._ids)
        out, result = [], None
        for turn in range(self.spec.session_turns):
            inputs = self._request(seed if turn == 0 else None)
            inputs = inputs if result is None else with_token(inputs, result)
            result = infer(client, self.spec.session_model, inputs, sequence_id=sid, sequence_start=turn == 0,
                           sequence_end=turn == self.spec.session_turns - 1)
            out.append(image_bytes(result))
        return out

    def references(self) -> None:
        """The bytes every later answer must equal, computed one request at a time."""
        client = self._client(0)
        try:
            for model in self.spec.models:
                for seed in self.spec.seeds:
                    self.expected[(model, seed)] = image_bytes(infer(client, model, self._request(seed)))
            if self.spec.session_model:
                for seed in self.spec.seeds:
                    self.expected_sessions[seed] = self.session_images(client, seed)
        finally:
            client.close()

    def _work(self, index: int, deadline: float, report: LoadReport) -> None:
        rng = np.random.default_rng(index)
        client = self._client(index)
        actions = [*self.spec.models, *([self.spec.session_model] if self.spec.session_model else [])]
        try:
            while time.monotonic() < deadline:
                model = actions[int(rng.integers(len(actions)))]
                seed = self.spec.seeds[int(rng.integers(len(self.spec.seeds)))]
                try:
                    if model == self.spec.session_model:
                        got, want = self.session_images(client, seed), self.expected_sessions[seed]
                        count = len(got)
                    else:
                        got, want = image_bytes(infer(client, model, self._request(seed))), self.expected[(model, seed)]
                        count = 1
                    with self._lock:
                        report.requests += count
                        report.sessions += model == self.spec.session_model
                        report.per_model[model] = report.per_model.get(model, 0) + count
                        if got != want:
                            report.mismatches.append(f"client {index}: {model} seed {seed}")
                except Exception as exc:  # noqa: BLE001 - counted, the run goes on
                    with self._lock:
                        report.errors.append(f"client {index}: {model} seed {seed}: {type(exc).__name__}: {exc}")
        finally:
            client.close()

    def run(self, seconds: float, warmup_s: float = 3.0) -> LoadReport:
        """References, a concurrent warm-up (not counted), the RSS baseline, the measured run."""
        if not self.expected:
            self.references()
        self._concurrent(warmup_s, LoadReport())
        time.sleep(0.5)
        report = LoadReport(rss_warm=self.server_rss())
        started = time.monotonic()
        self._concurrent(seconds, report)
        report.seconds = time.monotonic() - started
        time.sleep(0.5)
        report.rss_after = self.server_rss()
        return report

    def _concurrent(self, seconds: float, report: LoadReport) -> None:
        deadline = time.monotonic() + seconds
        threads = [threading.Thread(target=self._work, args=(i, deadline, report), name=f"load-{i}")
                   for i in range(self.spec.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=seconds + 600)  # a request may outlast the deadline; never forever
        if any(t.is_alive() for t in threads):
            report.errors.append("a client thread did not finish within 600 s after the deadline")
