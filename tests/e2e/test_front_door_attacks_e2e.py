"""The door under many clients and attackers, against the launcher (the session's ``door``,
its bounds made small: testing.door_attacks.SMALL_DOOR): idle connections lock no one out and do
not stay, large JSON is refused early and parsed away from the event loop while health answers,
a request reaches only the shared memory its client registered through the door, every bad input
is a 4xx naming its rule however its bytes arrive, and health and another client's requests are
answered while all of it happens at once.
"""

from __future__ import annotations

import gzip
import json
import re
import socket
import struct
import threading
import time
import zlib
from multiprocessing import shared_memory

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from neopp.launcher.admin import grpc_headers, http_headers
from neopp.launcher.door.bounds import HEADER_LIMIT
from neopp.launcher.door.shm_arena import PREFIX as DOOR_REGION
from neopp.launcher.shm_regions import SHM_DIR, owner_tag
from neopp.ports import LOOPBACK
from testing.door_attacks import SMALL_DOOR, Attacks, Probe, big_object, connect, post, read_answer, request
from testing.faults import wait_for
from testing.loadgen import grpc_inputs, http_inputs, image_bytes, valid_inputs

MODEL = "neopp_dense"
KEY = SMALL_DOOR.key
HEALTH = b"GET /v2/health/live HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"


def _inputs(kv, seed: int = 5):
    return valid_inputs(kv[0], kv[1], (24, 7), seed)


def _grpc_image(door, kv, seed: int = 5) -> bytes:
    client = grpcclient.InferenceServerClient(f"{LOOPBACK}:{door.grpc_port}")
    try:
        return image_bytes(client.infer(MODEL, grpc_inputs(_inputs(kv, seed)), client_timeout=120))
    finally:
        client.close()


def _metric(door, name: str) -> float:
    _, _, body = request(door.http_port, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    match = re.search(rf"^{name} (\S+)$", body.decode(), re.M)
    return float(match.group(1)) if match else 0.0


def _closed_by_door(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, TimeoutError):
        return False


def test_idle_connections_lock_no_one_out_and_do_not_stay(door):
    """300 connections of one client that send nothing: past its cap the ones idle longest give
    way (or, while none has been idle a second, the new one is refused), other clients are
    answered throughout, and the door closes every idle connection after the idle timeout; a head
    sent a byte at a time gets 408 then."""
    probe = Probe(door.http_port, source="127.0.0.6").start()
    flood = []
    for _ in range(300):
        try:
            flood.append(connect(door.http_port, source="127.0.0.5", timeout=5))
        except OSError:
            pass
    slow = connect(door.http_port, source="127.0.0.7")
    slow.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
    try:
        assert request(door.http_port, HEALTH, source="127.0.0.6")[0] == 200
        opened = _metric(door, "neopp_http_connections")
        assert opened <= SMALL_DOOR.per_client + 4, opened  # one client's cap, and the few of this test
        for _ in range(4):  # a byte at a time never makes a head: it gets no more time for it
            time.sleep(SMALL_DOOR.idle_s / 4)
            slow.sendall(b"X")
        status, _, body = read_answer(slow)
        assert status == 408 and b"no complete request head" in body, body
        assert all(_closed_by_door(sock, SMALL_DOOR.idle_s + 30) for sock in flood[:SMALL_DOOR.per_client])
        assert wait_for(lambda: _metric(door, "neopp_http_connections") <= 2, 30, poll=0.2)
    finally:
        probe.stop()
        for sock in (*flood, slow):
            sock.close()
    print(probe.summary())
    assert set(probe.statuses) == {200}, probe.statuses


def test_a_client_with_every_connection_busy_is_refused_while_others_are_served(door, kv):
    """One client's connections all hold requests (uploads in progress, some refused for want of
    an inference slot and drained): its next connection is a 503; health, metrics and another
    client's request are answered."""
    port, target = door.http_port, f"/v2/models/{MODEL}/infer"
    busy = []
    for _ in range(SMALL_DOOR.per_client):
        sock = connect(port, source="127.0.0.8")
        sock.sendall(f"POST {target} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {512 << 10}\r\n\r\n{{".encode())
        busy.append(sock)
    try:  # each upload stays busy for SMALL_DOOR.read_timeout_s: the checks below come first
        assert wait_for(lambda: _metric(door, "neopp_http_connections") >= SMALL_DOOR.per_client, 30, poll=0.1)
        client = httpclient.InferenceServerClient(f"{LOOPBACK}:{port}", network_timeout=120.0)
        try:  # the first SMALL_DOOR.inference uploads hold every slot: no inference for anyone now
            with pytest.raises(InferenceServerException) as info:
                client.infer(MODEL, http_inputs(_inputs(kv)))
            assert "inference requests are in flight" in info.value.message(), info.value.message()
        finally:
            client.close()
        status, headers, body = read_answer(connect(port, source="127.0.0.8"))
        assert status == 503 and headers.get("retry-after") == "1" and b"too many open connections" in body, body
        assert request(port, HEALTH, source="127.0.0.9")[0] == 200
        assert request(port, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")[0] == 200
        answers = [read_answer(sock)[0] for sock in busy]  # each falls behind the minimum rate
        assert set(answers) <= {408, 503}, answers
    finally:
        for sock in busy:
            sock.close()
    assert _grpc_image(door, kv)


def test_large_json_is_refused_early_and_parsed_away_from_the_event_loop(door):
    """The 9 MB object of 450k keys is refused on every route, most before it is read; documents
    the door must parse (12 MiB strings to generate) are parsed in a worker process; health and
    the door's metrics answer meanwhile."""
    port, obj = door.http_port, big_object()
    admin = "".join(f"{k}: {v}\r\n" for k, v in http_headers(KEY).items())
    expected = {f"/v2/models/{MODEL}/generate": (413, "over 65536 JSON values"),
                f"/v2/models/{MODEL}/infer": (413, "over the 1048576 byte limit for JSON"),
                "/v1/images/generations": (413, "65536 byte limit of openai requests"),
                "/v2/trace/setting": (413, "4194304 byte limit of control requests")}
    for route, (status, rule) in expected.items():
        got, _, body = post(port, route, obj, admin)
        assert got == status and rule in body.decode(), (route, body[:300])
    user = json.dumps({"prompt": "a red circle", "user": ["u"] * 1000}).encode()
    got, _, body = post(port, "/v1/images/generations", user)
    assert got == 400 and json.loads(body)["error"]["param"] == "user", body
    health, metrics = Probe(port, 0.02).start(), Probe(port, 0.02, path="/metrics").start()
    big = json.dumps({"OUTPUT_FORMAT": "p" * (12 << 20)}).encode()  # 3 x 12 MiB: within one client's share
    answers: list[tuple[int, bytes]] = []
    posters = [threading.Thread(target=lambda: answers.append(post(port, f"/v2/models/{MODEL}/generate", big)[::2]))
               for _ in range(3)]
    for thread in posters:
        thread.start()
    for thread in posters:
        thread.join(timeout=300)
    health.stop()
    metrics.stop()
    print(health.summary(), "|", metrics.summary())
    assert len(answers) == 3 and all(status == 400 and b"OUTPUT_FORMAT" in body for status, body in answers), \
        [(s, b[:200]) for s, b in answers]  # parsed by the door, refused by the model: it got that far
    assert set(health.statuses) == {200} and set(metrics.statuses) == {200}


def _register(port: int, name: str, key: str, size: int, source: str | None = None, with_key: bool = True) -> int:
    body = json.dumps({"key": key, "offset": 0, "byte_size": size}).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in http_headers(KEY).items()) if with_key else ""
    return request(port, f"POST /v2/systemsharedmemory/region/{name}/register HTTP/1.1\r\nHost: localhost\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n"
                   .encode() + body, source)[0]


def _infer_into(port: int, kv, region: str, headers: dict | None, source: str | None = None) -> tuple[int, dict]:
    """An infer request whose IMAGE goes into ``region``: (status, the answer's JSON)."""
    out = httpclient.InferRequestedOutput("IMAGE")
    out.set_shared_memory(region, 1 << 20)
    body, json_size = httpclient.InferenceServerClient.generate_request_body(http_inputs(_inputs(kv, seed=31)),
                                                                             outputs=[out])
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    status, _, answer = post(port, f"/v2/models/{MODEL}/infer", body,
                             f"Inference-Header-Content-Length: {json_size}\r\n{extra}", source)
    return status, json.loads(answer)


def test_a_request_reaches_only_the_shared_memory_its_client_registered(door, kv):
    port = door.http_port
    mine = shared_memory.SharedMemory(create=True, size=1 << 20)
    grpc_client = grpcclient.InferenceServerClient(f"{LOOPBACK}:{door.grpc_port}")
    other = shared_memory.SharedMemory(create=True, size=1 << 20)
    try:
        assert _register(port, "mine", "/" + mine.name, 1 << 20, with_key=False) == 403
        assert _register(port, "mine", "/" + mine.name, 1 << 20) == 200
        # registered over gRPC, as the LightLLM client does: not this door's to lend
        grpc_client.register_system_shared_memory("lightllm", "/" + other.name, 1 << 20, headers=grpc_headers(KEY))
        status, answer = _infer_into(port, kv, "mine", http_headers(KEY))
        assert status == 200, answer
        assert answer["outputs"][0] == {"name": "IMAGE", "datatype": "BYTES", "shape": [1]}  # written there
        (length,) = struct.unpack_from("<I", mine.buf, 0)
        assert bytes(mine.buf[4:4 + length]) == _grpc_image(door, kv, seed=31)
        door_file = next(p.name for p in SHM_DIR.glob(f"{DOOR_REGION}{owner_tag(door.proc.pid)}_*"))
        for region, headers, source, rule in (
                ("mine", None, None, "need the operator key"),
                ("mine", http_headers(KEY), "127.0.0.2", "not registered through this port by this client"),
                ("lightllm", http_headers(KEY), None, "not registered"),
                (door_file, http_headers(KEY), None, "not registered")):
            status, answer = _infer_into(port, kv, region, headers, source)
            assert status == 403 and rule in answer["error"], (region, answer)
        with pytest.raises(InferenceServerException) as info:  # over gRPC the door's file is no region name
            out = grpcclient.InferRequestedOutput("IMAGE")
            out.set_shared_memory(door_file, 1 << 20)
            grpc_client.infer(MODEL, grpc_inputs(_inputs(kv)), outputs=[out], client_timeout=120)
        assert "Unable to find shared memory region" in info.value.message()
        for key in (f"/{door_file}", "/neopp_shm_1-1_00000000_x"):  # the server's own shared memory
            assert _register(port, "theirs", key, 4096) == 403
        private = [p for p in SHM_DIR.iterdir() if p.name.startswith((door_file, *(s[2] for s in door.servers())))]
        assert private and all(p.stat().st_mode & 0o777 == 0o600 for p in private), \
            [(p.name, oct(p.stat().st_mode)) for p in private]
        status = request(port, b"POST /v2/systemsharedmemory/region/mine/unregister HTTP/1.1\r\nHost: localhost\r\n"
                         b"Content-Length: 0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in http_headers(KEY).items())
                         .encode() + b"Connection: close\r\n\r\n")[0]
        assert status == 200 and _infer_into(port, kv, "mine", http_headers(KEY))[0] == 403
    finally:
        try:
            grpc_client.unregister_system_shared_memory("lightllm", headers=grpc_headers(KEY))
        finally:
            grpc_client.close()
            for seg in (mine, other):
                seg.close()
                seg.unlink()


def _pieces(port: int, raw: bytes, size: int = 4096) -> tuple[int, dict, bytes]:
    """The same request, written in pieces with a pause between them."""
    with connect(port) as sock:
        for at in range(0, len(raw), size):
            try:
                sock.sendall(raw[at:at + size])
            except OSError:
                break
            time.sleep(0.001)
        return read_answer(sock)


def _deflated(data: bytes) -> bytes:
    return zlib.compress(data)


@pytest.mark.parametrize("name, target, body, extra, status, rule", [
    ("digits", "infer", b'{"inputs":[{"name":"X","datatype":"INT64","shape":[1],"data":[' + b"9" * 5000 + b"]}]}",
     "", 400, "40 digits"),
    ("surrogate in a prompt", "generate", b'{"PROMPT":"a \\ud800 circle"}', "", 400, "lone UTF-16 surrogate"),
    ("surrogate in an input name", "infer", b'{"inputs":[{"name":"\\udfff","datatype":"INT64","shape":[1],'
     b'"data":[1]}]}', "", 400, "lone UTF-16 surrogate"),
    ("surrogate in BYTES data", "infer", b'{"inputs":[{"name":"OUTPUT_FORMAT","datatype":"BYTES","shape":[1],'
     b'"data":["\\ud800"]}]}', "", 400, "lone UTF-16 surrogate"),
    ("infinite number", "/v2/trace/setting", b'{"trace_rate":1e999}', "admin", 400, "64-bit float"),
    ("gzip with junk after it", "infer", gzip.compress(b'{"inputs":[]}') + b"junk", "Content-Encoding: gzip\r\n",
     400, "after the end of its gzip stream"),
    ("deflate with junk after it", "infer", _deflated(b'{"inputs":[]}') + b"junk",
     "Content-Encoding: deflate\r\n", 400, "after the end of its deflate stream"),
    ("a /v1 body over its cap", "/v1/images/generations", b'{"prompt":"' + b"p" * 70_000 + b'"}', "", 413,
     "65536 byte limit"),
    ("a /v1 body over its cap, gzipped", "/v1/images/generations",
     gzip.compress(b'{"prompt":"' + b"p" * 70_000 + b'"}'), "Content-Encoding: gzip\r\n", 413, "inflates to more"),
    ("a header size in other digits", "infer", b"{}", "Inference-Header-Content-Length: \xb2\r\n", 400,
     "Inference-Header-Content-Length must be"),
])
def test_bad_input_is_a_4xx_naming_the_rule_however_it_arrives(door, name, target, body, extra, status, rule):
    path = target if target.startswith("/") else f"/v2/models/{MODEL}/{target}"
    extra = "".join(f"{k}: {v}\r\n" for k, v in http_headers(KEY).items()) if extra == "admin" else extra
    head = (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            f"{extra}Connection: close\r\n\r\n").encode("latin-1")
    for send in (lambda raw: request(door.http_port, raw), lambda raw: _pieces(door.http_port, raw)):
        got, _, answer = send(head + body)
        text = answer.decode(errors="replace")
        assert got == status and rule in text, (name, got, text[:300])
    assert "neopp front:" not in door.text() and "Traceback" not in door.text()


def test_request_heads_over_the_limit_are_431_in_one_read_or_many(door):
    pad = f"X-Pad: {'p' * (100 << 10)}\r\n"
    head = f"GET /v2/health/live HTTP/1.1\r\nHost: localhost\r\n{pad}\r\n"
    status, _, answer = request(door.http_port, head.encode())
    assert status == 431 and f"{HEADER_LIMIT} byte limit" in answer.decode(), answer[:300]
    unfinished = f"GET /v2/health/live HTTP/1.1\r\nHost: localhost\r\n{pad[:HEADER_LIMIT + 1024]}".encode()  # no end
    status, _, answer = _pieces(door.http_port, unfinished, 1024)
    assert status == 431 and f"{HEADER_LIMIT} byte limit" in answer.decode(), answer[:300]
    assert request(door.http_port, b"GET /v2/health/live HTTP/1.1\r\nHost: localhost\r\nX-Pad: "
                   + b"p" * (HEADER_LIMIT - 200) + b"\r\nConnection: close\r\n\r\n")[0] == 200
    status, _, answer = request(door.http_port, b"GET /v2/health/live HTTP/1.1\r\nHost x\r\n\r\n")  # malformed
    assert status == 400 and b"malformed" in answer
    chunked = (f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n"
               "Connection: close\r\n\r\n2\r\n{}\r\n0\r\n\r\n").encode()
    assert request(door.http_port, chunked)[0] == 411
    assert "Invalid HTTP request" not in door.text()


def test_health_and_requests_are_answered_while_every_attack_runs(door, kv):
    """The attacks of testing.door_attacks at once (idle connections, trickled uploads, 9 MB JSON
    objects, each from an address of its own) for 15 s: every health check answered, and another
    client's requests served with the same bytes. The goal for health is a p99 under 100 ms
    (docs/security.md has the figures and the command); the bound here, 1 s, leaves room for a
    machine busy with other work and still fails a door whose loop stops (the JSON parsed on it
    took a check to 2.6 s median, 10 s at most)."""
    baseline = Probe(door.http_port).start()
    time.sleep(3)  # a window of the probe without attacks, to compare
    baseline.stop()
    probe = Probe(door.http_port, source="127.0.0.10").start()
    attacks = Attacks(door.http_port, MODEL, idle=SMALL_DOOR.per_client * 2, declared=40 << 20,
                      trickle_every_s=1.0).start()
    expected = _grpc_image(door, kv, seed=41)
    client = httpclient.InferenceServerClient(f"{LOOPBACK}:{door.http_port}", network_timeout=120.0)
    served = []
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            served.append(image_bytes(client.infer(MODEL, http_inputs(_inputs(kv, seed=41)))) == expected)
    finally:
        client.close()
        attacks.stop()
        probe.stop()
    print("no attack:", baseline.summary())
    print("attacked: ", probe.summary(), "| attacks answered", dict(attacks.answers), f"| {len(served)} served")
    assert set(probe.statuses) == {200} and all(served) and served
    assert probe.percentile(0.99) < 1.0, probe.summary()
