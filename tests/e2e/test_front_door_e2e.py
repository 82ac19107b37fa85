"""The HTTP door against the real launcher (``python -m neopp.launcher serve``): the
requests that used to end the service are answered with a 4xx and the server lives on; request
bodies are bounded in size, in time and all together; a full model queue answers 429 at once;
a stub stopped by a signal is replaced, not resumed; no client's doing prints a traceback.

Each crash repro runs against the server this module starts, so a crash fails a test, not the suite.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from neopp.launcher.admin import grpc_headers, http_headers
from neopp.launcher.watchdog import model_stub_pids
from neopp.model.kv_cache import load_kv_file
from neopp.ports import LOOPBACK
from neopp.procs import process_group_members, rss_bytes
from testing.faults import wait_for
from testing.launched import launch

MODEL = "neopp_dense"
KEY = "door-operator-key-0123456789abcdef"
BUDGET_MIB, READ_TIMEOUT_S = 64, 3
SHAPE_BOMB = (b'{"inputs":[{"name":"INDEX_OFFSET_COND","datatype":"INT64","shape":[1000000000000],'
              b'"shape":[1],"data":[1]}]}')
PLAIN_BOMB = b'{"inputs":[{"name":"INDEX_OFFSET_COND","datatype":"INT64","shape":[1000000000000],"data":[1]}]}'


@pytest.fixture(scope="module")
def door(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("door") / "serve.log"
    handle = launch(log, {"NEOPP_CHECKPOINT": str(tiny_dense), "NEOPP_ADMIN_KEY": KEY}, (MODEL,), max_restarts=2,
                    launcher_args=["--bodies-in-flight-mib", str(BUDGET_MIB), "--read-timeout-s", str(READ_TIMEOUT_S),
                                   "--tensor-region-min-kib", "1"])  # the tiny KV goes through the region too
    try:
        handle.wait_for("NeoPP Triton server ready")
        yield handle
        assert "Traceback" not in handle.text(), "a request printed a traceback:\n" + handle.text()[-4000:]
    finally:
        servers = handle.servers()
        assert handle.stop() == 0, handle.text()[-4000:]
        for pid, _, _ in servers:
            assert process_group_members(pid) == [], f"server {pid} left processes"


@pytest.fixture(scope="module")
def kv(door, tiny_dense: Path) -> tuple[np.ndarray, np.ndarray]:
    sample = tiny_dense / "sample_kv"
    return tuple(load_kv_file(sample / f"{which}_kv.pt").float().numpy() for which in ("cond", "uncond"))


def _arrays(kv, size=(32, 32), steps=2, seed=5) -> dict[str, tuple[np.ndarray, str]]:
    return {"COND_KV": (kv[0], "BF16"), "UNCOND_KV": (kv[1], "BF16"),
            "INDEX_OFFSET_COND": (np.array([24], np.int64), "INT64"),
            "INDEX_OFFSET_UNCOND": (np.array([7], np.int64), "INT64"),
            "SIZE": (np.array(size, np.int64), "INT64"), "STEPS": (np.array([steps], np.int64), "INT64"),
            "SEED": (np.array([seed], np.int64), "INT64"), "OUTPUT_FORMAT": (np.array([b"png"], object), "BYTES")}


def _tensors(module, kv, **kwargs) -> list:
    tensors = []
    for name, (array, dtype) in _arrays(kv, **kwargs).items():
        tensor = module.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _grpc_image(door, kv, **kwargs) -> bytes:
    client = grpcclient.InferenceServerClient(f"{LOOPBACK}:{door.grpc_port}")
    try:
        return bytes(client.infer(MODEL, _tensors(grpcclient, kv, **kwargs), client_timeout=120).as_numpy("IMAGE")[0])
    finally:
        client.close()


def _raw(port: int, request: bytes, timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    """One request as bytes on a fresh connection: (status, headers, body)."""
    with socket.create_connection((LOOPBACK, port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
            head, blank, body = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: (\d+)", head)
            if blank and length and len(body) >= int(length.group(1)):
                break
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _post(port: int, target: str, body: bytes, extra: str = "") -> tuple[int, dict[str, str], bytes]:
    head = (f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n")
    return _raw(port, head.encode() + body)


def _alive(door, pid: int) -> None:
    assert door.server_pid == pid and process_group_members(pid), "tritonserver died"
    status, _, _ = _raw(door.http_port, b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 200


def test_duplicate_keys_and_absolute_uris_never_reach_triton(door, kv):
    pid = door.server_pid
    status, _, body = _post(door.http_port, f"/v2/models/{MODEL}/infer", SHAPE_BOMB)
    assert status == 400 and "duplicate key 'shape'" in json.loads(body)["error"]
    for bomb in (SHAPE_BOMB, PLAIN_BOMB):  # the request line's absolute form
        status, _, body = _post(door.http_port, f"http://x/v2/models/{MODEL}/infer", bomb)
        assert 400 <= status < 500 and json.loads(body)["error"]
    status, _, body = _post(door.http_port, f"/v2/models/{MODEL}/infer", PLAIN_BOMB)
    assert status == 400 and "shape [1000000000000] needs 1000000000000" in json.loads(body)["error"]
    _alive(door, pid)
    assert _grpc_image(door, kv)


def test_deep_json_is_refused_on_every_route(door):
    pid = door.server_pid
    for route, depth in (("generate", 1_000_000), ("generate_stream", 1_000_000), ("infer", 100_000)):
        status, _, body = _post(door.http_port, f"/v2/models/{MODEL}/{route}",
                                b'{"inputs":' + b"[" * depth + b"]" * depth + b"}")
        assert status == 400 and "nests deeper than" in json.loads(body)["error"], (route, body[:200])
    _alive(door, pid)


def test_gzip_requests_work_and_gzip_bombs_do_not_inflate(door, kv):
    client = httpclient.InferenceServerClient(f"{LOOPBACK}:{door.http_port}", network_timeout=120.0)
    try:
        plain = client.infer(MODEL, _tensors(httpclient, kv)).as_numpy("IMAGE")[0]
        packed = client.infer(MODEL, _tensors(httpclient, kv), request_compression_algorithm="gzip",
                              response_compression_algorithm="gzip").as_numpy("IMAGE")[0]
        deflated = client.infer(MODEL, _tensors(httpclient, kv), request_compression_algorithm="deflate")
    finally:
        client.close()
    assert plain == packed == deflated.as_numpy("IMAGE")[0] == _grpc_image(door, kv)
    pid = door.server_pid
    server_before, door_before = rss_bytes(process_group_members(pid)), rss_bytes([door.proc.pid])
    bomb = gzip.compress(b"{" + b" " * (512 << 20) + b"}", compresslevel=9)
    for target in (f"/v2/models/{MODEL}/infer", f"http://x/v2/models/{MODEL}/infer"):
        status, _, body = _post(door.http_port, target, bomb, "Content-Encoding: gzip\r\n")
        assert status in (404, 413), body[:200]
    server_after, door_after = rss_bytes(process_group_members(pid)), rss_bytes([door.proc.pid])
    print(f"gzip bomb ({len(bomb)} B -> 512 MiB): tritonserver {server_before >> 20} -> {server_after >> 20} MiB, "
          f"door {door_before >> 20} -> {door_after >> 20} MiB")
    assert server_after < server_before * 1.10 and door_after < door_before + (160 << 20)
    _alive(door, pid)


def test_large_json_tensors_are_sent_to_the_binary_extension(door):
    values = b",".join([b"1.5"] * 1_500_000)
    body = b'{"inputs":[{"name":"X","datatype":"FP32","shape":[1500000],"data":[' + values + b"]}]}"
    status, _, answer = _post(door.http_port, f"/v2/models/{MODEL}/infer", body)
    assert status == 413 and "binary tensor extension" in json.loads(answer)["error"]


def _stalled_upload(port: int, declared: int, sent: int) -> socket.socket:
    sock = socket.create_connection((LOOPBACK, port), timeout=60)
    sock.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n"
                 f"Inference-Header-Content-Length: 2\r\n\r\n".encode() + b"{}" + bytes(sent - 2))
    return sock


def _metrics_text(door) -> str:
    _, _, body = _raw(door.http_port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    return body.decode()


def _door_metric(door, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", _metrics_text(door), re.M)
    return float(match.group(1)) if match else 0.0


def test_stalled_uploads_are_dropped_and_bodies_in_flight_are_bounded(door, kv):
    first = _stalled_upload(door.http_port, 40 << 20, 1 << 20)  # holds 40 of the 64 MiB budget
    try:
        wait_for(lambda: _door_metric(door, "neopp_http_body_bytes_held") >= 40 << 20, 30, poll=0.1)
        # answered before a byte of the body is sent: at once, not queued
        status, headers, body = _raw(door.http_port, f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\n"
                                     f"Content-Length: {30 << 20}\r\n\r\n".encode())
        assert status == 503 and headers.get("retry-after") == "1", body[:200]
        status, _, body = _post(door.http_port, f"/v2/models/{MODEL}/infer", b"x" * (30 << 20))
        assert status == 503, body[:200]  # a client that sends it all reads the answer, not a reset
        first.settimeout(READ_TIMEOUT_S + 60)
        answer = first.recv(4096)  # the door answers the stalled sender and closes
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    finally:
        first.close()
    assert wait_for(lambda: _door_metric(door, "neopp_http_body_bytes_held") == 0, 30, poll=0.1)
    assert _grpc_image(door, kv)


def test_connections_reset_mid_request_print_nothing(door):
    for sent in (b"GET /v2/health/re", b"POST /v2/models/x/infer HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"):
        sock = socket.create_connection((LOOPBACK, door.http_port), timeout=10)
        sock.sendall(sent)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # RST
    time.sleep(0.5)
    assert "Traceback" not in door.text()


def _load(door, config: dict | None) -> None:
    body = json.dumps({"parameters": {"config": json.dumps(config)}} if config else {}).encode()
    status, _, answer = _post(door.http_port, f"/v2/repository/models/{MODEL}/load", body,
                              "".join(f"{k}: {v}\r\n" for k, v in http_headers(KEY).items()))
    assert status == 200, answer[:300]


def test_a_full_queue_answers_429_over_http_and_unavailable_over_grpc(door, kv):
    client = grpcclient.InferenceServerClient(f"{LOOPBACK}:{door.grpc_port}")
    config = client.get_model_config(MODEL, as_json=True, headers=grpc_headers(KEY))["config"]
    config["dynamic_batching"] = {"default_queue_policy": {"max_queue_size": 1}}
    _load(door, config)  # through the door's control route, with the operator key
    answers: list[str] = []

    def http_one() -> None:
        c = httpclient.InferenceServerClient(f"{LOOPBACK}:{door.http_port}", network_timeout=300.0)
        try:
            c.infer(MODEL, _tensors(httpclient, kv, size=(512, 512), steps=40))
            answers.append("ok")
        except InferenceServerException as exc:
            answers.append(f"http {exc.status()} {exc.message()}")
        finally:
            c.close()

    def grpc_one() -> None:
        try:
            client.infer(MODEL, _tensors(grpcclient, kv, size=(512, 512), steps=40), client_timeout=300)
            answers.append("ok")
        except InferenceServerException as exc:
            answers.append(f"grpc {exc.status()} {exc.message()}")

    try:
        threads = [threading.Thread(target=f) for f in (http_one, grpc_one) * 4]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        print(answers)
        assert "ok" in answers
        assert any(a.startswith("http 429") and "Exceeds maximum queue size" in a for a in answers), answers
        assert all(a == "ok" or "Exceeds maximum queue size" in a for a in answers), answers
    finally:
        _load(door, None)  # back to config.pbtxt
        client.close()


def test_a_stopped_stub_is_killed_and_its_model_reloaded(door, kv):
    pid = door.server_pid
    expected = _grpc_image(door, kv, seed=11)
    stubs = model_stub_pids(pid, MODEL)  # every instance: whichever one Triton picks is stopped
    for stub in stubs:
        os.kill(stub, signal.SIGSTOP)
    try:
        client = httpclient.InferenceServerClient(f"{LOOPBACK}:{door.http_port}", network_timeout=120.0)
        with pytest.raises(InferenceServerException):  # Triton answers "not healthy" after 1 s
            client.infer(MODEL, _tensors(httpclient, kv, seed=11))
        client.close()
        for stub in stubs:
            door.wait_for(rf"neopp watchdog: {MODEL}_\d+_\d+: .*killing its stub {stub} \(SIGKILL\)", timeout=60)
    finally:
        for stub in stubs:
            try:
                os.kill(stub, signal.SIGCONT)  # what aborted tritonserver when the stub was resumed
            except ProcessLookupError:
                pass
    door.wait_for(rf"neopp watchdog: {MODEL}: reload done", timeout=120)
    deadline, got = time.monotonic() + 120, None
    while got != expected and time.monotonic() < deadline:
        try:
            got = _grpc_image(door, kv, seed=11)
        except InferenceServerException:
            time.sleep(0.5)
    assert got == expected
    _alive(door, pid)


def test_binary_inputs_reach_a_restarted_server_through_the_region_again(door, kv):
    """The door registers its tensor region with the server it first talks to; a new server does
    not know it, and the door registers it again, once, without losing the request."""
    client = httpclient.InferenceServerClient(f"{LOOPBACK}:{door.http_port}", network_timeout=120.0)
    try:
        before = client.infer(MODEL, _tensors(httpclient, kv, seed=21)).as_numpy("IMAGE")[0]
        pid = door.server_pid
        os.kill(pid, signal.SIGKILL)
        door.wait_for(r"tritonserver pid", count=2, timeout=120)
        wait_for(lambda: door.server_pid != pid and _ready(door), 300, poll=0.5)
        after = client.infer(MODEL, _tensors(httpclient, kv, seed=21)).as_numpy("IMAGE")[0]
    finally:
        client.close()
    assert after == before == _grpc_image(door, kv, seed=21)
    restarts = re.search(r'neopp_server_restarts_total\{reason="signal 9"\} (\S+)', _metrics_text(door))
    assert restarts and float(restarts.group(1)) == 1.0


def _ready(door) -> bool:
    try:
        status, _, _ = _raw(door.http_port, f"GET /v2/models/{MODEL}/ready HTTP/1.1\r\nHost: x\r\n"
                            "Connection: close\r\n\r\n".encode(), timeout=5)
        return status == 200
    except OSError:
        return False
