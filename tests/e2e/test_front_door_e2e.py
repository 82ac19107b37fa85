"""The HTTP door against the real launcher (``python -m neopp.launcher serve``): the
requests that used to end the service are answered with a 4xx and the server lives on; request
bodies are bounded in size, in time and all together; a full model queue answers 429 at once;
a restarted server gets the door's tensor region again; no client's doing prints a traceback.
Stub health against the same launcher is in test_stub_death_e2e.py.

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

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from neopp.launcher.admin import grpc_headers, http_headers
from neopp.ports import LOOPBACK
from neopp.procs import process_group_members, rss_bytes
from testing.door_attacks import SMALL_DOOR, connect, post, read_answer, request
from testing.door_requests import MODEL, alive, grpc_image, ready, tensors
from testing.faults import wait_for

KEY, CLIENT_MIB, READ_TIMEOUT_S = SMALL_DOOR.key, SMALL_DOOR.client_mib, SMALL_DOOR.read_timeout_s
SHAPE_BOMB = (b'{"inputs":[{"name":"INDEX_OFFSET_COND","datatype":"INT64","shape":[1000000000000],'
              b'"shape":[1],"data":[1]}]}')
PLAIN_BOMB = b'{"inputs":[{"name":"INDEX_OFFSET_COND","datatype":"INT64","shape":[1000000000000],"data":[1]}]}'


def test_duplicate_keys_and_absolute_uris_never_reach_triton(door, kv):
    pid = door.server_pid
    status, _, body = post(door.http_port, f"/v2/models/{MODEL}/infer", SHAPE_BOMB)
    assert status == 400 and "duplicate key 'shape'" in json.loads(body)["error"]
    for bomb in (SHAPE_BOMB, PLAIN_BOMB):  # the request line's absolute form
        status, _, body = post(door.http_port, f"http://x/v2/models/{MODEL}/infer", bomb)
        assert 400 <= status < 500 and json.loads(body)["error"]
    status, _, body = post(door.http_port, f"/v2/models/{MODEL}/infer", PLAIN_BOMB)
    assert status == 400 and "shape [1000000000000] needs 1000000000000" in json.loads(body)["error"]
    alive(door, pid)
    assert grpc_image(door, kv)


def test_deep_json_is_refused_on_every_route(door):
    pid = door.server_pid
    for route, depth in (("generate", 1_000_000), ("generate_stream", 1_000_000), ("infer", 100_000)):
        status, _, body = post(door.http_port, f"/v2/models/{MODEL}/{route}",
                                b'{"inputs":' + b"[" * depth + b"]" * depth + b"}")
        assert status == 400 and "nests deeper than" in json.loads(body)["error"], (route, body[:200])
    alive(door, pid)


def test_gzip_requests_work_and_gzip_bombs_do_not_inflate(door, kv):
    client = httpclient.InferenceServerClient(f"{LOOPBACK}:{door.http_port}", network_timeout=120.0)
    try:
        plain = client.infer(MODEL, tensors(httpclient, kv)).as_numpy("IMAGE")[0]
        packed = client.infer(MODEL, tensors(httpclient, kv), request_compression_algorithm="gzip",
                              response_compression_algorithm="gzip").as_numpy("IMAGE")[0]
        deflated = client.infer(MODEL, tensors(httpclient, kv), request_compression_algorithm="deflate")
    finally:
        client.close()
    assert plain == packed == deflated.as_numpy("IMAGE")[0] == grpc_image(door, kv)
    pid = door.server_pid
    server_before, door_before = rss_bytes(process_group_members(pid)), rss_bytes([door.proc.pid])
    bomb = gzip.compress(b"{" + b" " * (512 << 20) + b"}", compresslevel=9)
    for target in (f"/v2/models/{MODEL}/infer", f"http://x/v2/models/{MODEL}/infer"):
        status, _, body = post(door.http_port, target, bomb, "Content-Encoding: gzip\r\n")
        assert status in (404, 413), body[:200]
    server_after, door_after = rss_bytes(process_group_members(pid)), rss_bytes([door.proc.pid])
    print(f"gzip bomb ({len(bomb)} B -> 512 MiB): tritonserver {server_before >> 20} -> {server_after >> 20} MiB, "
          f"door {door_before >> 20} -> {door_after >> 20} MiB")
    assert server_after < server_before * 1.10 and door_after < door_before + (160 << 20)
    alive(door, pid)


def test_large_json_tensors_are_sent_to_the_binary_extension(door):
    values = b",".join([b"1.5"] * 1_500_000)
    body = b'{"inputs":[{"name":"X","datatype":"FP32","shape":[1500000],"data":[' + values + b"]}]}"
    status, _, answer = post(door.http_port, f"/v2/models/{MODEL}/infer", body)
    assert status == 413 and "binary tensor extension" in json.loads(answer)["error"]


BINARY = "Inference-Header-Content-Length: 2\r\n"  # a body of "{}" and a binary part


def _stalled_upload(port: int, declared: int, sent: int, source: str | None = None) -> socket.socket:
    sock = connect(port, source, timeout=60)
    sock.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: localhost\r\nContent-Length: {declared}\r\n"
                 f"Inference-Header-Content-Length: 2\r\n\r\n".encode() + b"{}" + bytes(sent - 2))
    return sock


def _metrics_text(door) -> str:
    _, _, body = request(door.http_port, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
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
        status, headers, body = request(door.http_port, f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: localhost\r\n"
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
    assert grpc_image(door, kv)


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
        status, _, body = request(door.http_port, f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: localhost\r\n"
                                  f"Content-Length: {10 << 20}\r\n{BINARY}\r\n".encode(), source="127.0.0.4")
        assert status == 503 and b"its share" in body, body[:300]
        assert _http_image(door, kv) == grpc_image(door, kv)  # another client, served meanwhile
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
        return bytes(client.infer(MODEL, tensors(httpclient, kv, **kwargs)).as_numpy("IMAGE")[0])
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
    status, _, answer = post(door.http_port, f"/v2/repository/models/{MODEL}/load", body,
                              "".join(f"{k}: {v}\r\n" for k, v in http_headers(KEY).items()))
    assert status == 200, answer[:300]


def test_a_full_queue_answers_429_over_http_and_unavailable_over_grpc(door, kv):
    """More gRPC clients than the instances and the queue of one hold keep resubmitting long
    requests, so the queue is full nearly all the time; each protocol then probes one request at
    a time until the queue refuses it. A probe the queue took simply waits its turn, so the
    outcome never rests on which request came first."""
    client = grpcclient.InferenceServerClient(f"{LOOPBACK}:{door.grpc_port}")
    config = client.get_model_config(MODEL, as_json=True, headers=grpc_headers(KEY))["config"]
    config["dynamic_batching"] = {"default_queue_policy": {"max_queue_size": 1}}
    _load(door, config)  # through the door's control route, with the operator key
    answers: list[str] = []
    stop = threading.Event()
    long = {"size": (512, 512), "steps": 40}

    def grpc_one() -> str:
        try:
            client.infer(MODEL, tensors(grpcclient, kv, **long), client_timeout=300)
            return "ok"
        except InferenceServerException as exc:
            return f"grpc {exc.status()} {exc.message()}"

    def http_one() -> str:
        c = httpclient.InferenceServerClient(f"{LOOPBACK}:{door.http_port}", network_timeout=300.0)
        try:
            c.infer(MODEL, tensors(httpclient, kv, **long))
            return "ok"
        except InferenceServerException as exc:
            return f"http {exc.status()} {exc.message()}"
        finally:
            c.close()

    def keep_busy() -> None:
        for _ in range(500):
            if stop.is_set():
                return
            answers.append(grpc_one())
            if answers[-1] != "ok":
                stop.wait(0.05)  # refused at once: try again without spinning

    def probe(one, refusal: str) -> str:
        for _ in range(12):
            answer = one()
            answers.append(answer)
            if answer.startswith(refusal):
                return answer
        raise AssertionError(f"the queue never refused a {refusal.split()[0]} request: {answers}")

    instances = sum(group.get("count", 1) for group in config["instance_group"])
    busy = [threading.Thread(target=keep_busy) for _ in range(instances + 2)]
    try:
        for t in busy:
            t.start()
        assert "Exceeds maximum queue size" in probe(http_one, "http 429")
        assert "Exceeds maximum queue size" in probe(grpc_one, "grpc StatusCode.UNAVAILABLE")
    finally:
        stop.set()
        for t in busy:
            t.join(timeout=300)
        _load(door, None)  # back to config.pbtxt
        client.close()
    assert "ok" in answers
    assert all(a == "ok" or "Exceeds maximum queue size" in a for a in answers), answers


def test_binary_inputs_reach_a_restarted_server_through_the_region_again(door, kv):
    """The door registers its tensor region with the server it first talks to; a new server does
    not know it, and the door registers it again, once, without losing the request."""
    client = httpclient.InferenceServerClient(f"{LOOPBACK}:{door.http_port}", network_timeout=120.0)
    try:
        before = client.infer(MODEL, tensors(httpclient, kv, seed=21)).as_numpy("IMAGE")[0]
        pid = door.server_pid
        os.kill(pid, signal.SIGKILL)
        door.wait_for(r"tritonserver pid", count=2, timeout=120)
        wait_for(lambda: door.server_pid != pid and ready(door), 300, poll=0.5)
        after = client.infer(MODEL, tensors(httpclient, kv, seed=21)).as_numpy("IMAGE")[0]
    finally:
        client.close()
    assert after == before == grpc_image(door, kv, seed=21)
    restarts = re.search(r'neopp_server_restarts_total\{reason="signal 9"\} (\S+)', _metrics_text(door))
    assert restarts and float(restarts.group(1)) == 1.0


