"""The link between a model's stubs and the stub that runs its engine, in one process.

The wire (framing, memory files, BF16 through DLPack without torch, every check on what
arrives), then a real engine behind a real socket: requests from two links share its steps and
equal their solo pixels; a cancellation, a link that closes and an engine that goes away each end
the requests they touch, with the right answer. Through Triton the same path is covered by the
e2e suites (tests/e2e/test_batched_serving_e2e.py and the rest).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.dlpack import to_dlpack

from neopp.engines.batch_engine import BatchingEngine
from neopp.limits import Limits
from neopp.serving.engine_host import EngineHost
from neopp.serving.engine_link import EngineLink
from neopp.serving.model_settings import TritonModelSettings
from neopp.serving.wire import (
    MAX_HEADER,
    WireError,
    bf16_capsule,
    bf16_view,
    exported_tensors,
    memory_file,
    recv_message,
    send_message,
    unpack_tensors,
)
from testing.local_tensors import LocalTensor, request_tensors
from testing.stream_requests import make, tiny_setup

TIMEOUT_S = 120
HELD: list[int] = []  # what the host reports as the requests it holds


# ---------------------------------------------------------------- the wire

def test_a_message_with_blobs_and_a_memory_file_crosses_a_socket():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    payload = np.arange(100_000, dtype=np.int64)
    fd = memory_file(payload.ctypes.data, payload.nbytes, "test")
    try:
        send_message(a, {"type": "x", "n": 1}, [b"abc", b""], [fd])
        header, blobs, fds = recv_message(b)
        assert header == {"type": "x", "n": 1, "blobs": [3, 0]} and blobs == [b"abc", b""] and len(fds) == 1
        with mmap.mmap(fds[0], payload.nbytes, prot=mmap.PROT_READ) as view:
            assert np.array_equal(np.frombuffer(view, dtype=np.int64), payload)
        os.close(fds[0])
    finally:
        os.close(fd)
        a.close()
        b.close()


def test_bf16_is_read_through_dlpack_without_torch():
    t = torch.randn(2, 3, 5).to(torch.bfloat16)
    capsule = to_dlpack(t)
    address, shape, nbytes = bf16_view(capsule)
    assert shape == (2, 3, 5) and nbytes == 60
    assert ctypes.string_at(address, nbytes) == t.view(torch.int16).numpy().tobytes()
    with pytest.raises(WireError, match="not BF16"):
        bf16_view(to_dlpack(torch.zeros(3)))
    with pytest.raises(WireError, match="contiguous"):
        bf16_view(to_dlpack(t.transpose(0, 2)))


def test_bf16_is_handed_out_through_dlpack_without_torch():
    """A front builds a BF16 output from the bytes it received: a capsule torch (here) or Triton
    consumes, whose memory is let go when the consumer frees it, or with the capsule if unused."""
    import gc

    t = torch.randn(3, 2, 5).to(torch.bfloat16)
    raw = t.view(torch.uint8).numpy().tobytes()
    held = exported_tensors()
    tensor = torch.utils.dlpack.from_dlpack(bf16_capsule(raw, [3, 2, 5]))
    assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, t) and exported_tensors() == held + 1
    del tensor
    gc.collect()
    unused = bf16_capsule(raw, [3, 2, 5])
    del unused
    gc.collect()
    assert exported_tensors() == held
    with pytest.raises(WireError, match="are not a BF16 tensor of shape"):
        bf16_capsule(raw[:-2], [3, 2, 5])


def test_the_forwarding_stubs_import_no_torch():
    code = ("import sys, neopp.serving.triton_model, neopp.serving.prompt_encoder_model; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


@pytest.mark.parametrize("raw, why", [
    (struct.pack("<I", MAX_HEADER + 1), "over the limit"),
    (struct.pack("<I", 12) + b'{"blobs":NaN}', "NaN is not JSON"),
    (struct.pack("<I", 15) + b'{"blobs":[-1]} ', "blob sizes"),
    (struct.pack("<I", 2) + b"[]", "blob sizes"),
    (struct.pack("<I", 40) + b'{"blobs":[]}', "closed"),  # cut short
])
def test_a_malformed_message_is_refused(raw, why):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        a.sendall(raw)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(WireError, match=why):
            recv_message(b)
    finally:
        a.close()
        b.close()


def test_unpacking_checks_every_description_against_its_bytes():
    ok = unpack_tensors([{"name": "A", "datatype": "INT64", "shape": [2], "blob": 0}], [np.arange(2).tobytes()], [],
                        1 << 20)
    assert ok["A"].tolist() == [0, 1]
    cases = [
        ([{"name": "A", "datatype": "INT64", "shape": [3], "blob": 0}], [b"x" * 16], "16 bytes for shape"),
        ([{"name": "A", "datatype": "INT64", "shape": [1], "blob": 0}] * 2, [b"x" * 8], "given twice"),
        ([{"name": "A", "datatype": "INT32", "shape": [1], "blob": 0}], [b"x" * 4], "unknown datatype"),
        ([{"name": "A", "datatype": "FP32", "shape": [1 << 30], "blob": 0}], [b""], "over 1048576 bytes"),
        ([{"name": "A", "datatype": "BYTES", "shape": [2], "blob": 0}], [struct.pack("<I", 9) + b"ab"], "cut short"),
        ([{"name": "A", "datatype": "BF16", "shape": [4], "fd": 0}], [], "no such memory file"),
    ]
    for specs, blobs, why in cases:
        with pytest.raises(WireError, match=why):
            unpack_tensors(specs, blobs, [], 1 << 20)


# ---------------------------------------------------------------- a real engine behind the socket

@pytest.fixture()
def host(tmp_path_factory):
    ckpt, pipe, kvs = tiny_setup(tmp_path_factory.mktemp("link"))
    settings = TritonModelSettings(model_name="link_test", checkpoint=ckpt, mode_file=Path("-"), lora_dir=Path("-"),
                                   device_param="cpu", dtype_name="float32", num_threads=1, worker_processes=0,
                                   collective_timeout_s=60.0, default_task="t2i", limits=Limits())
    stopping = threading.Event()
    engine = BatchingEngine(pipe)
    owner = f"link_test_{os.getpid()}"
    errors: list[str] = []
    served = EngineHost(owner, engine, settings, pipe.mode, stopping, errors.append, HELD.append)
    yield served, pipe, kvs
    served.close()
    engine.close()


def run(link: EngineLink, tensors, cancelled=lambda: False) -> list[tuple[dict, list[bytes]]]:
    got: queue.Queue = queue.Queue()
    link.submit(tensors, None, lambda h, b: got.put((h, b)), cancelled, final_only=True)
    out = []
    while True:
        header, blobs = got.get(timeout=TIMEOUT_S)
        out.append((header, blobs))
        if header["type"] in ("final", "error"):
            return out


def test_requests_from_two_links_equal_solo(host):
    served, pipe, kvs = host
    links = [EngineLink(served.owner, "link_test", "plain") for _ in range(2)]
    reqs = [make(kvs, i, 64, 64, 6, seed=10 + i) for i in range(2)]
    results: dict[int, list] = {}
    def one(i: int) -> None:
        results[i] = run(links[i], request_tensors(reqs[i], 10 + i))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    for i, req in enumerate(reqs):
        messages = results[i]
        assert [h["type"] for h, _ in messages] == ["accepted"] + ["step"] * 5 + ["final"]
        header, blobs = messages[-1]
        pixels = np.frombuffer(blobs[0], dtype=np.uint8).reshape(header["shape"])
        assert np.array_equal(pixels, pipe.generate(req)), f"request {i}"
        assert header["summary"]["size"] == "64x64" and len(blobs[1]) > 0  # the stream state after it
    for link in links:
        link.close()


def test_a_refusal_names_the_input(host):
    served, _, kvs = host
    link = EngineLink(served.owner, "link_test", "plain")
    tensors = [t for t in request_tensors(make(kvs, 0, 64, 64, 2, 1), 1) if t.name() != "SIZE"]
    tensors.append(LocalTensor("SIZE", np.array([33, 64])))
    (header, _), = run(link, tensors)
    assert header["status"] == "INVALID_ARG" and header["message"].startswith("SIZE: ")
    link.close()


def test_a_request_over_its_byte_limit_is_refused_naming_input_and_limit(host):
    served, _, kvs = host
    req = make(kvs, 0, 64, 64, 2, 1)
    tensors, cond_bytes = request_tensors(req, 1), req.cond_kv.numel() * 2  # sent as BF16
    served.admission.settings = replace(served.admission.settings, limits=Limits(max_request_bytes=cond_bytes))
    link = EngineLink(served.owner, "link_test", "plain")
    (header, _), = run(link, tensors)
    assert header["status"] == "INVALID_ARG", header
    assert header["message"].startswith("COND_KV: ") and "max_request_bytes" in header["message"], header
    link.close()


def test_the_requests_held_are_counted_until_their_last_message(host):
    served, _, kvs = host
    HELD.clear()
    link = EngineLink(served.owner, "link_test", "plain")
    run(link, request_tensors(make(kvs, 0, 64, 64, 3, seed=5), 5))
    link.close()
    assert HELD == [1, 0]


def test_cancellation_and_a_lost_engine_end_the_requests_they_touch(host):
    served, _, kvs = host
    link = EngineLink(served.owner, "link_test", "plain")
    got: queue.Queue = queue.Queue()
    stepped = threading.Event()
    deliver = lambda h, b: (h["type"] == "step" and stepped.set(), got.put(h))  # noqa: E731
    link.submit(request_tensors(make(kvs, 0, 64, 64, 200, 1), 1), None, deliver, stepped.is_set, True)
    last = got.get(timeout=TIMEOUT_S)
    while last["type"] not in ("final", "error"):
        last = got.get(timeout=TIMEOUT_S)
    assert last["status"] == "CANCELLED" and "cancelled before step" in last["message"]

    link.submit(request_tensors(make(kvs, 0, 64, 64, 200, 2), 2), None, lambda h, b: got.put(h), lambda: False, True)
    while got.get(timeout=TIMEOUT_S)["type"] != "step":
        pass
    served.close()  # the engine's stub goes away: it stops listening and its connections close
    for conn in list(served._connections):
        conn.sock.shutdown(socket.SHUT_RDWR)
    last = got.get(timeout=TIMEOUT_S)
    while last["type"] == "step":
        last = got.get(timeout=TIMEOUT_S)
    assert last["type"] == "error" and last["status"] == "UNAVAILABLE" and "went away" in last["message"]
    link.close()


def test_a_link_that_closes_cancels_its_requests(host):
    served, _, kvs = host
    link = EngineLink(served.owner, "link_test", "plain")
    got: queue.Queue = queue.Queue()
    link.submit(request_tensors(make(kvs, 0, 64, 64, 200, 3), 3), None, lambda h, b: got.put(h), lambda: False, True)
    while got.get(timeout=TIMEOUT_S)["type"] != "step":
        pass
    link.close()
    engine = served.engine
    deadline = threading.Event()
    for _ in range(int(TIMEOUT_S / 0.1)):  # bounded: the engine drops it at its next step
        if not engine._tickets and not engine.loop.active:
            break
        deadline.wait(0.1)
    assert not engine._tickets and not engine.loop.active


def test_the_hello_is_checked(host):
    served, _, _ = host
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(served.path))
    send_message(sock, {"type": "hello", "front": "../etc", "kind": "plain"})
    assert sock.recv(1) == b""  # closed at once
    sock.close()
    assert served.path.stat().st_mode & 0o777 == 0o600 and served.path.parent.stat().st_mode & 0o777 == 0o700
