"""The launcher's defaults against a real server it started (``python -m neopp.launcher
serve``, with an API key): administrative APIs need the operator key over HTTP and gRPC, every
inference route needs the API key (the door's and gRPC's) while health stays open, a JSON shape
that used to abort Triton is refused by the HTTP front, refused oversized bodies leave no memory
behind, a dead stub is reloaded through the key, a dead server is restarted and its shared-memory
regions removed (how regions go with their owner: test_shm_regions_e2e).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from neopp.launcher.admin import GRPC_API_KEY_HEADER, grpc_headers, http_headers
from neopp.launcher.shm_regions import regions
from neopp.procs import (
    cmdline,
    descendants,
    model_stubs,
    ppid,
    process_group_members,
    rss_bytes,
    rss_parts,
    stub_instance,
)
from testing.faults import kill_own_stub, wait_for
from testing.grpc_memory import refused_burst
from testing.launched import serving

MODEL = "neopp_dense"
KEY = "test-operator-key-0123456789abcdef"
API = "test-api-key-0123456789abcdef"
HTTP_API = {"Authorization": f"Bearer {API}"}
GRPC_API = {GRPC_API_KEY_HEADER: f"Bearer {API}"}
SHAPE_BOMB = {"inputs": [{"name": "INDEX_OFFSET_COND", "datatype": "INT64", "shape": [1000000000000],
                          "data": [1]}]}


@pytest.fixture(scope="module")
def launched(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("launcher") / "serve.log"
    with serving(log, {"NEOPP_CHECKPOINT": str(tiny_dense), "NEOPP_ADMIN_KEY": KEY, "NEOPP_API_KEY": API}, (MODEL,),
                 max_restarts=2) as handle:
        yield handle
    for pid, _, prefix in handle.servers():
        assert regions(prefix) == [], f"server {pid} left shm regions {regions(prefix)}"


def _generate(client, kv: tuple[np.ndarray, np.ndarray], seed: int = 5, with_key: bool = True) -> bytes:
    """One small guided request over ``client``'s protocol (with the API key); returns the PNG bytes."""
    mod = grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient
    headers = (GRPC_API if mod is grpcclient else HTTP_API) if with_key else None
    arrays = {"COND_KV": (kv[0], "BF16"), "UNCOND_KV": (kv[1], "BF16"),
              "INDEX_OFFSET_COND": (np.array([24], np.int64), "INT64"),
              "INDEX_OFFSET_UNCOND": (np.array([7], np.int64), "INT64"),
              "SIZE": (np.array([32, 32], np.int64), "INT64"), "STEPS": (np.array([2], np.int64), "INT64"),
              "SEED": (np.array([seed], np.int64), "INT64"),
              "OUTPUT_FORMAT": (np.array([b"png"], object), "BYTES")}
    tensors = []
    for name, (array, dtype) in arrays.items():
        tensor = mod.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return bytes(client.infer(MODEL, tensors, headers=headers).as_numpy("IMAGE")[0])


def _http(port: int, path: str, body: dict | None = None, headers: dict | None = None) -> int:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers or {},
                                 method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _upload_request(marker: Path) -> dict:
    """What an attacker sends: a new model whose model.py writes ``marker`` when loaded."""
    code = f"open({str(marker)!r}, 'w').write('ran')\nclass TritonPythonModel:\n    pass\n"
    config = {"name": "uploaded", "backend": "python", "input": [], "output": []}
    return {"parameters": {"config": json.dumps(config),
                           "file:1/model.py": base64.b64encode(code.encode()).decode()}}


def test_admin_apis_need_the_key_over_http(launched, kv, tmp_path):
    port, marker = launched.http_port, tmp_path / "uploaded_code_ran"
    refused = {"/v2/repository/index": {}, "/v2/repository/models/uploaded/load": _upload_request(marker),
               f"/v2/repository/models/{MODEL}/unload": {},
               "/v2/systemsharedmemory/region/probe/register": {"key": "/probe", "offset": 0,
                                                                "byte_size": 64}}
    for path, body in refused.items():
        assert _http(port, path, body) == 403, path
    assert _http(port, f"/v2/models/{MODEL}/config") == 403
    assert not marker.exists(), "uploaded code ran without the key"
    assert _http(port, "/v2/repository/index", {}, http_headers(KEY)) == 200
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=120.0)
    try:
        assert client.is_server_ready() and client.is_model_ready(MODEL)
        assert client.get_model_metadata(MODEL)["name"] == MODEL
        assert _generate(client, kv)
    finally:
        client.close()


def test_admin_apis_need_the_key_over_grpc(launched, kv, tmp_path):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{launched.grpc_port}")
    marker = tmp_path / "uploaded_code_ran"
    upload = _upload_request(marker)["parameters"]
    calls = [lambda h: client.get_model_repository_index(headers=h),
             lambda h: client.load_model("uploaded", config=upload["config"], headers=h,
                                         files={"file:1/model.py":
                                                base64.b64decode(upload["file:1/model.py"])}),
             lambda h: client.unload_model(MODEL, headers=h),
             lambda h: client.register_system_shared_memory("probe", "/probe", 64, headers=h),
             lambda h: client.get_model_config(MODEL, headers=h)]
    try:
        for call in calls:
            with pytest.raises(InferenceServerException) as info:
                call(None)
            assert "restricted" in info.value.message(), info.value.message()
        assert not marker.exists(), "uploaded code ran without the key"
        index = client.get_model_repository_index(headers=grpc_headers(KEY), as_json=True)
        names = [m["name"] for m in index["models"]]
        assert MODEL in names and "uploaded" not in names
        assert client.is_model_ready(MODEL)
        assert _generate(client, kv)
    finally:
        client.close()


def test_json_shape_bomb_is_refused_and_the_server_lives(launched):
    pid = launched.server_pid  # Triton's own HTTP is a private socket (test_inner_port_e2e)
    headers = {"Content-Type": "application/json", **HTTP_API}
    assert _http(launched.http_port, f"/v2/models/{MODEL}/infer", SHAPE_BOMB, headers) == 400
    time.sleep(1.0)
    assert launched.server_pid == pid and process_group_members(pid), "the server died"
    assert _http(launched.http_port, "/v2/health/ready") == 200


def _server_rss(pid: int) -> int:
    return rss_bytes([pid, *descendants(pid)])


def _post_oversized(port: int, size: int) -> int | str:
    shape = [2, 2, size // 256, 2, 32]
    header = json.dumps({"inputs": [{"name": "COND_KV", "datatype": "BF16", "shape": shape,
                                     "parameters": {"binary_data_size": size}}]}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", f"/v2/models/{MODEL}/infer", body=header + bytes(size),
                     headers={"Inference-Header-Content-Length": str(len(header)),
                              "Content-Type": "application/octet-stream", **HTTP_API})
        return conn.getresponse().status
    except (ConnectionError, http.client.HTTPException) as exc:
        return type(exc).__name__
    finally:
        conn.close()


def test_refused_oversized_requests_keep_no_memory(launched, kv):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{launched.grpc_port}")
    try:
        assert _generate(client, kv)  # warm
        pid = launched.server_pid
        before = _server_rss(pid)
        answers = [_post_oversized(launched.http_port, 200 * 1024 * 1024) for _ in range(5)]
        after = _server_rss(pid)
        print(f"RSS of tritonserver and its stubs: {before / 2**20:.1f} MiB -> "
              f"{after / 2**20:.1f} MiB; {answers}")
        assert all(a == 413 for a in answers), answers
        assert after < before * 1.10, (before, after)
        assert _generate(client, kv)
    finally:
        client.close()


def test_refused_oversized_grpc_requests_keep_no_memory(launched, kv):
    """A COND_KV of the wrong geometry is refused by Triton's core, so only tritonserver's gRPC
    buffers held it: with no request pool and the malloc settings they go back to the OS. (Each
    is within the gRPC front's bound, so it reaches Triton.)"""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{launched.grpc_port}")
    try:
        assert _generate(client, kv)  # one normal request, then "before"
        pid = launched.server_pid
        before = rss_parts(process_group_members(pid))
        answers = refused_burst(client, "geometry", 5, 100 * 2**20, GRPC_API)
        after = rss_parts(process_group_members(pid))
        print(f"gRPC, 5 refused 100 MiB requests: RSS of tritonserver and its stubs "
              f"{before['total'] / 2**20:.1f} -> {after['total'] / 2**20:.1f} MiB")
        assert all("INVALID_ARGUMENT" in a and "unexpected shape" in a for a in answers), answers
        assert after["total"] < before["total"] * 1.10, (before, after)
        assert _generate(client, kv)
    finally:
        client.close()


def _rss_settled(pid: int, ok, timeout: float = 30.0) -> dict[str, int]:
    """The server's RSS parts once ``ok`` holds for them, or the last reading after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not ok(parts := rss_parts(process_group_members(pid))) and time.monotonic() < deadline:
        time.sleep(0.5)
    return parts


def test_oversized_prefixes_the_model_refuses_grow_the_region_once(launched, kv):
    """The right geometry with too many tokens is copied into the region of the stub Triton gives
    it before the model refuses it: each stub's region grows to hold the largest such request (two
    at most), then is reused, whichever instance takes each request."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{launched.grpc_port}")
    size, slack = 100 * 2**20, 32 * 2**20
    try:
        assert _generate(client, kv)
        pid = launched.server_pid
        stubs = model_stubs(pid, MODEL)
        before = rss_parts(process_group_members(pid))
        stub_before = {s: rss_parts([s])["shmem"] for s in stubs}
        answers = refused_burst(client, "tokens", len(stubs) + 2, size, GRPC_API)
        answers += refused_burst(client, "tokens", len(stubs) + 2, size, GRPC_API)
        # gRPC frees the last request's buffers after answering; on a loaded machine that can
        # lag the answer, so wait (bounded) for the sizes the asserts below expect
        after = _rss_settled(pid, lambda m: m["anon"] < before["anon"] * 1.10)
        grown = {f"{stub_instance(cmdline(s))} ({s})": rss_parts([s])["shmem"] - stub_before[s] for s in stubs}
        print(f"gRPC, 2 x {len(stubs) + 2} refused {size >> 20} MiB prefixes over {len(stubs)} instances: RSS "
              f"{before['total'] / 2**20:.1f} -> {after['total'] / 2**20:.1f} MiB, region growth per stub (MiB) "
              f"{[round(g / 2**20) for g in grown.values()]}")
        assert all("INVALID_ARGUMENT" in a and "exceeds the limit" in a for a in answers), answers
        # a region holds one request (plus a growth step), two at most when Triton copied the next
        # request into it before the stub had let go of the last one; never more, however many came
        assert all(g <= 2 * size + slack for g in grown.values()), grown
        # and it is mapped by the stub and by tritonserver, nothing else
        assert after["shmem"] - before["shmem"] <= 2 * sum(max(g, 0) for g in grown.values()) + slack, (before, after)
        assert after["anon"] < before["anon"] * 1.10, (before, after)  # nothing kept on the heap
        assert _generate(client, kv)
    finally:
        client.close()


def test_dead_stub_is_reloaded_with_the_key(launched, kv):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{launched.grpc_port}")
    try:
        expected = _generate(client, kv, 9)
        kill_own_stub(launched.server_pid, model_stubs(launched.server_pid, MODEL)[0])
        launched.wait_for(rf"neopp watchdog: {MODEL}: reload done", timeout=180)
        deadline, got = time.monotonic() + 120, None
        while got != expected and time.monotonic() < deadline:
            try:
                got = _generate(client, kv, 9)
            except InferenceServerException:
                time.sleep(0.5)
        assert got == expected
        assert "reload failed" not in launched.text()
    finally:
        client.close()


def test_dead_server_is_restarted_and_its_regions_removed(launched, kv):
    pid, _, prefix = launched.servers()[-1]
    assert regions(prefix), "a running server has its regions"
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)  # what an abort (std::bad_alloc, signal 6) leaves: stubs and regions
    launched.wait_for(r"NeoPP Triton server ready|restarting tritonserver", count=2, timeout=60)
    launched.wait_for(r"tritonserver pid", count=2, timeout=60)
    assert regions(prefix) == [], "the dead server's regions were not removed"
    assert "exited with code -9" in launched.text()
    new_pid = launched.server_pid
    assert new_pid != pid and ppid(new_pid) == launched.proc.pid
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{launched.grpc_port}")
    try:
        deadline = time.monotonic() + 300
        while not (_ready(client) and _door_ready(launched.http_port)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _generate(client, kv)
        print(f"server killed -> serving again after {time.monotonic() - killed_at:.1f}s")
    finally:
        client.close()


def _ready(client: grpcclient.InferenceServerClient) -> bool:
    try:
        return client.is_model_ready(MODEL)
    except InferenceServerException:
        return False


def _door_ready(port: int) -> bool:
    """The door's readiness, the launcher's facts: after a restart Triton's model may answer ready
    a moment before the launcher has seen the new server up, and until then the door answers
    inference UNAVAILABLE ("tritonserver is starting"), as a client would be told to retry."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/v2/health/ready")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def _status(port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **headers})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_every_inference_route_needs_the_api_key_and_health_does_not(launched, kv):
    """The door's infer, generate, generate_stream and /v1 answer 401 without the key; Triton's
    gRPC inference (unary and streamed) is refused without it; health and metadata stay open."""
    port = launched.http_port
    for route in ("infer", "generate", "generate_stream"):
        for headers, status in (({}, 401), ({"Authorization": "Bearer wrong-key-0123456789"}, 401)):
            got, body = _status(port, f"/v2/models/{MODEL}/{route}", b'{"SEED": 1}', headers)
            assert got == status and b"API key" in body, (route, got, body[:200])
        got, body = _status(port, f"/v2/models/{MODEL}/{route}", b'{"SEED": 1}', HTTP_API)
        assert got not in (401, 403), (route, got, body[:200])  # past the key: the request's own fault
    got, body = _status(port, "/v1/images/generations", b'{"prompt": "a red circle"}', {})
    assert got == 401 and json.loads(body)["error"]["message"].startswith("Incorrect or missing API key")
    grpc_client = grpcclient.InferenceServerClient(f"127.0.0.1:{launched.grpc_port}")
    http_client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=120.0)
    try:
        for client in (grpc_client, http_client):
            with pytest.raises(InferenceServerException) as info:
                _generate(client, kv, with_key=False)
            assert "restricted" in info.value.message() or "API key" in info.value.message(), info.value.message()
            assert _generate(client, kv) and client.is_server_live() and client.is_model_ready(MODEL)
            assert client.get_model_metadata(MODEL)
        answers: list = []
        grpc_client.start_stream(callback=lambda result, error: answers.append(error or result))
        try:
            grpc_client.async_stream_infer(MODEL, [])
        except InferenceServerException:
            pass  # refused at the stream's opening already: the callback holds why
        assert wait_for(lambda: answers, 60)
        grpc_client.stop_stream()
        assert isinstance(answers[0], InferenceServerException) and "restricted" in answers[0].message()
    finally:
        grpc_client.close()
        http_client.close()

