"""The HTTP door against the real launcher (``python -m neopp.launcher serve``): the
requests that used to end the service are answered with a 4xx and the server lives on; request
bodies are bounded in size, in time and all together; a full model queue answers 429 at once;
a stub stopped by a signal is replaced, not resumed; no client's doing prints a traceback.

Health comes from what the launcher owns, never from error text: a planted "not healthy" kills
nothing, a busy stub is never killed, one stub death under traffic is one reload (503 with
Retry-After meanwhile, never 500, and the replica unready), a stub killed holding a lock it shares
with tritonserver aborts the server and the launcher brings it back, and liveness holds while
idle connections fill the door.

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
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from neopp.launcher.admin import grpc_headers, http_headers
from neopp.launcher.door.limits import DoorLimits
from neopp.launcher.stub_kill import holds_robust_lock
from neopp.ports import LOOPBACK
from neopp.procs import model_stubs, process_group_members, rss_bytes
from testing.door_attacks import SMALL_DOOR, connect, post, read_answer, request
from testing.faults import wait_for
from testing.stub_recovery import stub_death_under_traffic

MODEL = "neopp_dense"
KEY, CLIENT_MIB, READ_TIMEOUT_S = SMALL_DOOR.key, SMALL_DOOR.client_mib, SMALL_DOOR.read_timeout_s
SHAPE_BOMB = (b'{"inputs":[{"name":"INDEX_OFFSET_COND","datatype":"INT64","shape":[1000000000000],'
              b'"shape":[1],"data":[1]}]}')
PLAIN_BOMB = b'{"inputs":[{"name":"INDEX_OFFSET_COND","datatype":"INT64","shape":[1000000000000],"data":[1]}]}'


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


def _raw(port: int, raw: bytes, timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    """One request as bytes on a fresh connection: (status, headers, body)."""
    return request(port, raw, timeout=timeout)


def _post(port: int, target: str, body: bytes, extra: str = "") -> tuple[int, dict[str, str], bytes]:
    return post(port, target, body, extra)


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


BINARY = "Inference-Header-Content-Length: 2\r\n"  # a body of "{}" and a binary part


def _stalled_upload(port: int, declared: int, sent: int, source: str | None = None) -> socket.socket:
    sock = connect(port, source, timeout=60)
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
    """A body holds what has arrived of it; one that does not fit in what is left is refused at
    once, and one that stalls is answered 408 once it falls behind the minimum rate."""
    first = _stalled_upload(door.http_port, 40 << 20, 24 << 20)  # holds the 24 MiB it sent
    try:
        assert wait_for(lambda: _door_metric(door, "neopp_http_body_bytes_held") >= 24 << 20, 30, poll=0.1)
        # answered before a byte of the body is sent: at once, not queued (24 + 45 > 64 MiB)
        status, headers, body = request(door.http_port, f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\n"
                                        f"Content-Length: {45 << 20}\r\n{BINARY}\r\n".encode(), source="127.0.0.3")
        assert status == 503 and headers.get("retry-after") == "1", body[:200]
        status, _, body = post(door.http_port, f"/v2/models/{MODEL}/infer", b"{}" + bytes((45 << 20) - 2), BINARY,
                               source="127.0.0.3")
        assert status == 503, body[:200]  # a client that sends it all reads the answer, not a reset
        first.settimeout(READ_TIMEOUT_S + 60)
        status, _, body = read_answer(first)  # the door answers the stalled sender and closes
        assert status == 408 and b"behind the minimum rate" in body, body[:200]
    finally:
        first.close()
    assert wait_for(lambda: _door_metric(door, "neopp_http_body_bytes_held") == 0, 30, poll=0.1)
    assert _grpc_image(door, kv)


def test_trickled_uploads_lock_no_one_out_and_no_client_holds_more_than_its_share(door, kv):
    """Three uploads declaring 40 MiB each and sending a byte every half second (a trickle) hold
    a few bytes and are answered 408 when they fall behind the rate; meanwhile another client's
    requests are served, and a client that holds its share of the budget gets 503 for more."""
    trickles = [_stalled_upload(door.http_port, 40 << 20, 2, source="127.0.0.2") for _ in range(3)]
    began, stop = time.monotonic(), threading.Event()

    def drip() -> None:
        while not stop.wait(0.5):
            for sock in trickles:
                try:
                    sock.send(b" ")
                except OSError:
                    pass
    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    holder = _stalled_upload(door.http_port, CLIENT_MIB - 4 << 20, CLIENT_MIB - 8 << 20, source="127.0.0.4")
    try:
        assert wait_for(lambda: _door_metric(door, "neopp_http_body_bytes_held") >= CLIENT_MIB - 8 << 20, 30,
                        poll=0.1)
        status, _, body = request(door.http_port, f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\n"
                                  f"Content-Length: {10 << 20}\r\n{BINARY}\r\n".encode(), source="127.0.0.4")
        assert status == 503 and b"its share" in body, body[:300]
        assert _http_image(door, kv) == _grpc_image(door, kv)  # another client, served meanwhile
        answers = [read_answer(sock)[0] for sock in trickles]
        assert answers == [408, 408, 408], answers
        print(f"trickles answered 408 after {time.monotonic() - began:.1f}s (grace {READ_TIMEOUT_S}s)")
    finally:
        stop.set()
        for sock in (*trickles, holder):
            sock.close()
    assert wait_for(lambda: _door_metric(door, "neopp_http_body_bytes_held") == 0, 30, poll=0.1)


def _http_image(door, kv, **kwargs) -> bytes:
    client = httpclient.InferenceServerClient(f"{LOOPBACK}:{door.http_port}", network_timeout=120.0)
    try:
        return bytes(client.infer(MODEL, _tensors(httpclient, kv, **kwargs)).as_numpy("IMAGE")[0])
    finally:
        client.close()


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
    stubs = model_stubs(pid, MODEL)  # every instance: whichever one Triton picks is stopped
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


def _http_infer(door, kv, seed: int) -> tuple[int, dict[str, str], bytes | None]:
    """One binary HTTP infer through the door on a fresh connection: (status, headers, image or None)."""
    body, json_size = httpclient.InferenceServerClient.generate_request_body(_tensors(httpclient, kv, seed=seed))
    head = (f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            + (f"Inference-Header-Content-Length: {json_size}\r\n" if json_size else "") + "Connection: close\r\n\r\n")
    status, headers, answer = _raw(door.http_port, head.encode() + body)
    if status != 200:
        return status, headers, None
    length = headers.get("inference-header-content-length")
    result = httpclient.InferenceServerClient.parse_response_body(answer, header_length=length and int(length))
    return status, headers, bytes(result.as_numpy("IMAGE")[0])


def test_a_planted_not_healthy_text_kills_no_stub(door, kv):
    """Triton echoes a client's input names in its errors: the text decides nothing."""
    pid = door.server_pid
    stubs = model_stubs(pid, MODEL)
    planted = f"Stub process '{MODEL}_0_0' is not healthy"
    body = json.dumps({"inputs": [{"name": planted, "shape": [1], "datatype": "INT64", "data": [1]}]}).encode()
    for route in ("infer", "generate"):
        status, _, answer = _post(door.http_port, f"/v2/models/{MODEL}/{route}", body)
        assert status == 400, (route, answer[:300])
    client = grpcclient.InferenceServerClient(f"{LOOPBACK}:{door.grpc_port}")
    planted_input = grpcclient.InferInput(planted, [1], "INT64")
    planted_input.set_data_from_numpy(np.array([1], np.int64))
    with pytest.raises(InferenceServerException, match="not healthy"):
        client.infer(MODEL, [planted_input])
    client.close()
    assert _grpc_image(door, kv)  # answered by the same stubs: nothing was killed or reloaded
    assert model_stubs(pid, MODEL) == stubs
    assert not any(f"killing its stub {stub}" in door.text() for stub in stubs)


def test_a_busy_stub_is_never_killed(door, kv):
    """A long legitimate request (512x512, 150 steps) outlasts the hung rule many times, with
    requests beside it: its engine computes (CPU advances), so the model keeps its stubs."""
    pid = door.server_pid
    stubs, killed = model_stubs(pid, MODEL), len(re.findall("killing its stub", door.text()))
    answers: list[str] = []

    def send(size: int, steps: int, seed: int) -> None:
        c = httpclient.InferenceServerClient(f"{LOOPBACK}:{door.http_port}", network_timeout=900.0)
        try:
            c.infer(MODEL, _tensors(httpclient, kv, size=(size, size), steps=steps, seed=seed))
            answers.append("ok")
        except InferenceServerException as exc:
            answers.append(f"{exc.status()} {exc.message()}")
        finally:
            c.close()

    started, steps = time.monotonic(), _steps(door)
    threads = [threading.Thread(target=send, args=(512, 150, 1))]
    threads[0].start()
    wait_for(lambda: _steps(door) > steps or not threads[0].is_alive(), 120, poll=0.05)  # it runs: queue more
    threads += [threading.Thread(target=send, args=(32, 2, seed)) for seed in (2, 3)]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout=900)
    print(f"a 512x512, 150-step request and two behind it: {time.monotonic() - started:.1f}s, {answers}")
    assert answers == ["ok"] * 3
    assert model_stubs(pid, MODEL) == stubs and len(re.findall("killing its stub", door.text())) == killed


def _steps(door) -> float:
    """Denoising steps the model has run (its own metric on Triton's metrics port)."""
    text = urllib.request.urlopen(f"http://{LOOPBACK}:{door.metrics_port}/metrics", timeout=10).read().decode()
    match = re.search(rf'^neopp_denoising_steps_total\{{model="{MODEL}"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_one_stub_death_under_traffic_is_one_recovery(door, kv):
    """A stub SIGKILLed while a client keeps calling: one reload, no loop, serving again as soon as
    the reload is done; meanwhile every answer is the image or 503 with Retry-After (never a 500)
    and the replica says it is not ready."""
    pid = door.server_pid
    expected = _grpc_image(door, kv, seed=31)

    def send() -> tuple[int, dict[str, str], bool]:
        status, headers, image = _http_infer(door, kv, seed=31)
        return status, headers, image == expected

    death = stub_death_under_traffic(door, MODEL, send)
    print(f"stub SIGKILL under traffic: {death.summary(MODEL)}\n"
          + "\n".join(line for line in death.log.splitlines() if "watchdog" in line or "warm-up" in line))
    assert all(right or (status == 503 and retry) for _, status, retry, right in death.answers), death.answers
    assert death.reloads(MODEL) == 1 and death.log.count(f"neopp watchdog: {MODEL}: reload done") == 1, death.log
    assert "reload failed" not in death.log and "killing its stub" not in death.log and door.server_pid == pid
    reload_s = float(re.search(rf"neopp watchdog: {MODEL}: reload done in ([\d.]+)s", death.log).group(1))
    assert death.recovery_s < reload_s + 5, "the launcher's own part: noticing the death and saying it is back"
    assert any(code != 200 for _, *codes in death.readiness for code in codes), "never unready while broken"
    assert death.readiness[-1][1:] == (200, 200)


def test_a_stub_killed_holding_a_shared_lock_is_contained(door, kv):
    """What aborted tritonserver under load, done on purpose: SIGKILL the stub at a moment the kernel
    lists a robust mutex it shares with the server as held (what neopp.launcher.stub_kill never does).
    When the server takes that lock again, Triton 2.51 aborts (lock_exception, signal 6) and the
    launcher restarts it; when it never does (a lock of one message), the watchdog reloads the model.
    Either way the door answers only the image or 503 with Retry-After, and the replica comes back."""
    expected, pid = _grpc_image(door, kv, seed=41), door.server_pid

    def send() -> tuple[int, dict[str, str], bool]:
        status, headers, image = _http_infer(door, kv, seed=41)
        return status, headers, image == expected

    looks: list[int] = []

    def kill_holding_a_lock(server_pid: int, stub: int) -> None:
        stop = threading.Event()

        def traffic() -> None:  # many short steps: a stub with a request talks to the server all the time
            client = grpcclient.InferenceServerClient(f"{LOOPBACK}:{door.grpc_port}")
            while not stop.is_set():
                try:
                    client.infer(MODEL, _tensors(grpcclient, kv, size=(32, 32), steps=40), client_timeout=60)
                except InferenceServerException:
                    break
            client.close()

        # one client per instance, so the stub always holds a request whichever instance it is
        workers = [threading.Thread(target=traffic) for _ in model_stubs(server_pid, MODEL)]
        for worker in workers:
            worker.start()
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                looks.append(1)
                os.kill(stub, signal.SIGSTOP)
                if holds_robust_lock(stub):
                    os.kill(stub, signal.SIGKILL)
                    return
                os.kill(stub, signal.SIGCONT)
                time.sleep(0.02)  # mostly running: never stopped long enough for the watchdog's rule
            os.kill(stub, signal.SIGCONT)
            pytest.fail(f"the stub never held a shared lock in {len(looks)} looks")
        finally:
            stop.set()
            for worker in workers:
                worker.join(timeout=120)

    death = stub_death_under_traffic(door, MODEL, send, timeout_s=300, kill=kill_holding_a_lock)
    aborted = "tritonserver exited with code -6" in death.log
    print(f"SIGKILL while holding a shared lock (after {len(looks)} looks): "
          f"{'tritonserver aborted' if aborted else 'tritonserver lived'}; {death.summary(MODEL)}")
    assert all(right or (status == 503 and retry) for _, status, retry, right in death.answers), death.answers
    if aborted:
        assert "boost::interprocess::lock_exception" in death.log and door.server_pid != pid
    else:
        assert death.log.count(f"neopp watchdog: {MODEL}: reload done") == 1 and door.server_pid == pid
    assert death.readiness[-1][1:] == (200, 200)


def test_liveness_holds_while_idle_connections_fill_the_door(door):
    """The liveness probe reads the launcher's alive file: it never connects to the door."""
    alive = door.log.parent / "alive"
    env = {**os.environ, "NEOPP_ALIVE_FILE": str(alive), "NEOPP_ALIVE_MAX_AGE_S": "30"}
    probe = [sys.executable, str(Path(__file__).parents[2] / "docker" / "live.py")]
    assert subprocess.run(probe, env=env, timeout=60).returncode == 0
    idle = []
    try:
        for _ in range(DoorLimits().max_connections + 8):
            idle.append(socket.create_connection((LOOPBACK, door.http_port), timeout=10))
        touched = alive.stat().st_mtime
        assert wait_for(lambda: alive.stat().st_mtime > touched, 30, poll=0.2), "the launcher stopped marking itself"
        result = subprocess.run(probe, env=env, timeout=60, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout
    finally:
        for sock in idle:
            sock.close()
    stale = {**env, "NEOPP_ALIVE_MAX_AGE_S": "0"}
    assert subprocess.run(probe, env=stale, timeout=60, capture_output=True).returncode == 1
