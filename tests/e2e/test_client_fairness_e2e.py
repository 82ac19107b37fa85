"""Fairness between clients against the real tritonserver, through the real door: a client past
its share of generations gets 429 with Retry-After while another client is served, ``/status``
counts clients without naming them, and the model's scheduler gives a client with nothing
running the next turn, however many requests another client queued before it.

The model runs one request at a time (``token_budget`` 1: every request is bigger than the budget,
so it runs alone), which makes the order of completions the order of the scheduler's turns."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from neopp.contract.client_lanes import PARAMETER
from neopp.engines.fault_point import FAULT_ENV
from neopp.launcher.door.bounds import DoorLimits
from neopp.launcher.door.grpc_front import GrpcFront
from neopp.launcher.door.server import DoorServer
from neopp.ports import LOOPBACK, free_ports
from testing.door_attacks import request, trickle_start
from tests.e2e.small_repo import SmallServer, write_repo

MODEL = "neopp_dense"
LIMIT = 8
STEPS = 60  # each request of the order tests: long enough that answers cannot overtake each other
INSTANCES = 4  # neopp_dense's instances: requests past them wait in Triton's queue
TIMEOUT_S = 120
OTHER = "127.0.0.2"  # a second client address on loopback


@pytest.fixture(scope="module")
def served(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("fairness")
    repo = write_repo(root, {}, 2048)
    config = repo / MODEL / "config.pbtxt"
    config.write_text(config.read_text().replace(
        "parameters [\n", 'parameters [\n  { key: "token_budget" value: { string_value: "1" } },\n'))
    hold = root / "hold"  # the loop's drill file: "hold" pauses the engine's loop before its next pass
    server = SmallServer(repo, tiny_dense, root / "tritonserver.log", {FAULT_ENV: str(hold)}).start()
    limits = DoorLimits(client_inference=LIMIT, read_timeout_s=300, min_upload_rate=1)  # a held upload stays
    door = DoorServer(LOOPBACK, 0, server.server.grpc_url, (LOOPBACK, server.server.http_port), "fair",
                      limits).start()
    front = GrpcFront(f"{LOOPBACK}:{free_ports(1)[0]}", server.server.grpc_url, 1 << 30,
                      clients=door.door.clients, budget=door.door.budget).start()  # as the launcher pairs them
    try:
        yield server, door.server_address[1], hold, front.address
    finally:
        front.stop()
        door.stop()
        assert server.stop() == [], "the server left processes behind"


def infer_raw(server: SmallServer, steps: int, size: int = 32) -> bytes:
    """A binary HTTP infer request of the tiny checkpoint, as bytes on the wire."""
    tensors = []
    for name, (array, dtype) in server.inputs(STEPS=(np.array([steps], np.int64), "INT64"),
                                              SIZE=(np.array([size, size], np.int64), "INT64")).items():
        tensor = httpclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    body, json_size = httpclient.InferenceServerClient.generate_request_body(tensors)
    head = (f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {json_size}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


def status(port: int) -> dict:
    code, _, body = request(port, b"GET /status?format=json HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    assert code == 200, body[:300]
    return json.loads(body)


def wait_for(check, what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_client_past_its_share_gets_429_while_another_client_is_served(served):
    server, port, *_ = served
    holds = [trickle_start(port, f"/v2/models/{MODEL}/infer", 1 << 20) for _ in range(LIMIT)]
    try:
        wait_for(lambda: (status(port)["clients"] or {}).get("in_flight") == LIMIT, "the held uploads")
        code, headers, body = request(port, infer_raw(server, 1))
        assert code == 429, body[:300]
        assert headers.get("retry-after", "").isdigit()
        assert f"the {LIMIT} one client may have" in json.loads(body)["error"]
        code, _, body = request(port, infer_raw(server, 1), source=OTHER)
        assert code == 200, body[:300]
        shown = status(port)["clients"]
        assert shown["limit_per_client"] == LIMIT and shown["clients"] == 1 and shown["in_flight"] == LIMIT
        assert shown["busiest"][0]["in_flight"] == LIMIT and shown["busiest"][0]["client"].startswith("client-")
        page = request(port, b"GET /status HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")[2]
        assert b"127.0.0.1" not in page and b'id="clients"' in page
    finally:
        for sock in holds:
            sock.close()
    wait_for(lambda: (status(port)["clients"] or {}).get("in_flight") == 0, "the held uploads to be given back")
    code, _, body = request(port, infer_raw(server, 1))
    assert code == 200, body[:300]


def test_grpc_clients_count_against_the_same_share(served):
    """The gRPC front counts a client's inferences in the door's table: with its share held over
    HTTP, its gRPC request (unary or in a stream) is refused UNAVAILABLE naming the limit; once
    given back, both are served and counted nowhere."""
    server, port, _, grpc_address = served
    client = grpcclient.InferenceServerClient(grpc_address)
    holds = [trickle_start(port, f"/v2/models/{MODEL}/infer", 1 << 20) for _ in range(LIMIT)]
    try:
        wait_for(lambda: (status(port)["clients"] or {}).get("in_flight") == LIMIT, "the held uploads")
        with pytest.raises(InferenceServerException) as refused:
            client.infer(MODEL, server.tensors(), client_timeout=TIMEOUT_S)
        assert refused.value.status() == "StatusCode.UNAVAILABLE", refused.value.message()
        assert f"the {LIMIT} one client may have" in refused.value.message()
        streamed = _streamed(client, server)
        assert streamed[0].startswith("error:") and "one client may have" in streamed[0], streamed
    finally:
        for sock in holds:
            sock.close()
    wait_for(lambda: (status(port)["clients"] or {}).get("in_flight") == 0, "the held uploads to be given back")
    assert client.infer(MODEL, server.tensors(), client_timeout=TIMEOUT_S).as_numpy("IMAGE") is not None
    assert _streamed(client, server) == ["image"]
    wait_for(lambda: (status(port)["clients"] or {}).get("in_flight") == 0, "the gRPC requests to be given back")
    client.close()


def _streamed(client: grpcclient.InferenceServerClient, server: SmallServer) -> list[str]:
    """One request on a stream of its own: what its answers were."""
    answers: list[str] = []
    client.start_stream(callback=lambda result, error: answers.append(
        f"error: {error.message()}" if error else "image"))
    try:
        client.async_stream_infer(MODEL, server.tensors())
        wait_for(lambda: answers, "the stream's answer")
    finally:
        client.stop_stream()
    return answers


def metric(server: SmallServer, name: str) -> float:
    """One of the model's series on the server's metrics port (0 when absent)."""
    text = urllib.request.urlopen(server.server.metrics_url, timeout=10).read().decode()
    found = re.search(rf'^{name}{{[^}}]*model="{MODEL}"[^}}]*}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


class Clients:
    """Requests sent on threads, and the order they finished in."""

    def __init__(self, server: SmallServer, port: int) -> None:
        self.server, self.port = server, port
        self.finished: list[str] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def send(self, name: str, source: str | None = None) -> None:
        def run() -> None:
            code, _, body = request(self.port, infer_raw(self.server, STEPS), source=source, timeout=TIMEOUT_S)
            with self.lock:
                self.finished.append(name if code == 200 else f"{name}:{code}:{body[:200]!r}")
        self.threads.append(threading.Thread(target=run, daemon=True))
        self.threads[-1].start()

    def join(self) -> list[str]:
        for thread in self.threads:
            thread.join(TIMEOUT_S)
        return self.finished


def waiting(server: SmallServer, in_engine: int, in_queue: int = 0) -> Callable[[], bool]:
    return lambda: (metric(server, "neopp_engine_requests") >= in_engine
                    and metric(server, "nv_inference_pending_request_count") >= in_queue)


def test_a_client_s_first_request_passes_another_client_s_backlog_in_the_engine(served):
    """With the engine's loop held, A sends three requests, then B one (all four reach the
    engine: one per instance); released, the engine runs A's first, then B's (its lane's turn),
    then the rest of A's."""
    server, port, hold, _ = served
    clients = Clients(server, port)
    hold.write_text("hold")
    try:
        for n in range(1, INSTANCES):  # one at a time, so they arrive in this order
            clients.send(f"A{n}")
            wait_for(waiting(server, n), f"A{n} in the engine")
        clients.send("B", OTHER)
        wait_for(waiting(server, INSTANCES), "B in the engine")
    finally:
        hold.unlink()
    assert clients.join() == ["A1", "B", "A2", "A3"]


def test_a_client_s_first_request_passes_another_client_s_backlog_in_triton_s_queue(served):
    """A fills the instances and queues two more in Triton's queue, then B sends one: the door
    gives B's first generation the first priority, so Triton hands it on before A's queued ones
    (and the engine gives it the next turn)."""
    server, port, hold, _ = served
    clients = Clients(server, port)
    hold.write_text("hold")
    try:
        for n in range(1, INSTANCES + 3):
            clients.send(f"A{n}")
            wait_for(waiting(server, min(n, INSTANCES), max(n - INSTANCES, 0)), f"A{n} in the engine or queued")
        clients.send("B", OTHER)
        wait_for(waiting(server, INSTANCES, 3), "B queued")
    finally:
        hold.unlink()
    finished = clients.join()
    assert sorted(finished) == sorted(["B", *(f"A{n}" for n in range(1, INSTANCES + 3))]), finished
    # B waits in Triton's queue until A1's instance is free, and is handed on first: it reaches
    # the engine while A2 runs and has the next turn there. In arrival order it would be fifth.
    assert finished.index("B") < min(finished.index(f"A{n}") for n in range(INSTANCES, INSTANCES + 3)), finished


def test_a_grpc_client_may_name_its_lane_and_a_bad_lane_is_refused_by_name(served):
    server, *_ = served
    ok = server.grpc.infer(MODEL, server.tensors(), parameters={PARAMETER: "lightllm:user-7"},
                           client_timeout=TIMEOUT_S)
    assert ok.as_numpy("IMAGE")[0]
    with pytest.raises(InferenceServerException, match=f"parameter {PARAMETER}") as refused:
        server.grpc.infer(MODEL, server.tensors(), parameters={PARAMETER: "no spaces allowed"},
                          client_timeout=TIMEOUT_S)
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
