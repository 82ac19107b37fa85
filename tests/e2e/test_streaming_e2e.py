"""The streaming models over the real server: gRPC streams, cancellation, metrics, and SSE
(``generate_stream``) through the HTTP front."""

from __future__ import annotations

import base64
import http.client
import io
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from conftest import COND_TOKENS, UNCOND_TOKENS
from PIL import Image

from neopp.ports import LOOPBACK
from testing import REPO

I64 = np.int64
STREAM, CFG_STREAM = "neopp_dense_stream", "neopp_dense_cfg_stream"
STEPS = "neopp_denoising_steps_total"
CANCELLED = {"reason": "cancelled"}
LONG = dict(SIZE=np.array([1024, 1024], I64), STEPS=np.array([200], I64), SEED=np.array([4], I64))


def stream(triton, model: str, cancel_after: int | None = None, timeout: float = 180.0,
           **overrides: Any) -> list[tuple[Any, Any]]:
    """(result, error) of every response of one streamed request, in arrival order, until the
    final one (or, with ``cancel_after``, cancel the stream after that many responses)."""
    client = grpcclient.InferenceServerClient(triton.server.grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    out: list[tuple[Any, Any]] = []
    try:
        client.async_stream_infer(model, triton.grpc_tensors(**overrides))
        deadline = time.monotonic() + timeout
        while True:
            result, error = answers.get(timeout=max(0.1, deadline - time.monotonic()))
            out.append((result, error))
            if error is not None or final(result):
                return out
            if cancel_after is not None and len(out) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return out
    finally:
        client.stop_stream()
        client.close()


def final(result: Any) -> bool:
    param = result.get_response().parameters.get("triton_final_response")
    return bool(param and param.bool_param)


def outputs(result: Any) -> set[str]:
    return {o.name for o in result.get_response().outputs}


def step_of(result: Any) -> tuple[int, int]:
    return int(result.as_numpy("STEP")[0]), int(result.as_numpy("TOTAL_STEPS")[0])


def plain(triton, model: str, **overrides: Any) -> Any:
    return triton.grpc.infer(model, triton.grpc_tensors(**overrides), client_timeout=180)


def test_steps_in_order_previews_and_the_plain_model_s_image(triton):
    ask = dict(SEED=np.array([11], I64), STEPS=np.array([5], I64))
    answers = stream(triton, STREAM, PREVIEW_EVERY=np.array([2], I64), PREVIEW_SIZE=np.array([48, 40], I64), **ask)
    assert all(error is None for _, error in answers), [e for _, e in answers if e]
    results = [r for r, _ in answers]
    assert [step_of(r) for r in results] == [(1, 5), (2, 5), (3, 5), (4, 5), (5, 5)]  # one response a step
    assert [final(r) for r in results] == [False] * 4 + [True]
    assert ["PREVIEW" in outputs(r) for r in results[:-1]] == [False, True, False, True]
    assert all("IMAGE" not in outputs(r) for r in results[:-1])
    for r in results[1:4:2]:
        preview = Image.open(io.BytesIO(r.as_numpy("PREVIEW")[0]))
        assert preview.format == "JPEG" and preview.size == (40, 48)  # PIL: (width, height)
    want = plain(triton, "neopp_dense", **ask)
    assert results[-1].as_numpy("IMAGE")[0] == want.as_numpy("IMAGE")[0]
    np.testing.assert_array_equal(results[-1].as_numpy("NEXT_RNG_STATE"), want.as_numpy("NEXT_RNG_STATE"))


def test_cfg_stream_gives_the_plain_cfg_model_s_image_with_progress_and_previews(triton):
    ask = dict(SEED=np.array([12], I64), STEPS=np.array([3], I64))
    results = [r for r, error in stream(triton, CFG_STREAM, PREVIEW_EVERY=np.array([1], I64), **ask)
               if error is None]
    assert [step_of(r) for r in results] == [(1, 3), (2, 3), (3, 3)] and final(results[-1])
    assert ["PREVIEW" in outputs(r) for r in results] == [True, True, False]  # the last carries the image
    assert results[-1].as_numpy("IMAGE")[0] == plain(triton, "neopp_dense_cfg", **ask).as_numpy("IMAGE")[0]


def test_four_concurrent_streams_each_give_their_own_plain_image(triton):
    seeds = [21, 22, 23, 24]
    want = {s: plain(triton, "neopp_dense", SEED=np.array([s], I64)).as_numpy("IMAGE")[0] for s in seeds}
    got: dict[int, Any] = {}

    def run(seed: int) -> None:
        got[seed] = stream(triton, STREAM, SEED=np.array([seed], I64), PREVIEW_EVERY=np.array([1], I64))

    threads = [threading.Thread(target=run, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for seed in seeds:
        last, error = got[seed][-1]
        assert error is None and final(last), error
        assert [step_of(r)[0] for r, _ in got[seed]] == [1, 2, 3, 4]
        # Streams that overlap share steps; each image is still the plain model's, byte for byte.
        assert last.as_numpy("IMAGE")[0] == want[seed], f"seed {seed}: not the plain model's image"
    assert len(set(want.values())) == 4


def test_cancelling_the_stream_stops_between_steps_and_the_model_goes_on(triton):
    start = triton.metric(STEPS, model=STREAM)
    cancelled_before = triton.metric("neopp_failures_total", model=STREAM, **CANCELLED)
    answers = stream(triton, STREAM, cancel_after=1, **LONG)
    assert step_of(answers[0][0]) == (1, 200)
    cancelled = triton.wait_metric("neopp_failures_total", cancelled_before + 1, model=STREAM, **CANCELLED)
    assert cancelled == cancelled_before + 1, "the model never observed the cancellation"
    ran = triton.metric(STEPS, model=STREAM) - start
    assert 1 <= ran < 200, f"cancelled request ran {ran} of 200 steps"
    results = [r for r, error in stream(triton, STREAM, SEED=np.array([1], I64)) if error is None]
    assert final(results[-1]) and triton.image(results[-1]).size == (64, 64)
    assert triton.metric(STEPS, model=STREAM) == start + ran + 4, "the cancelled generation kept stepping"
    assert triton.grpc.is_model_ready(STREAM)


# A test run started in the background (``make test &``) ignores SIGINT, and a child inherits that:
# the client would never see the Ctrl-C. The child sets Python's own handler, what a user's
# terminal gives it, before the script runs. (Setting it between fork and exec instead runs Python
# in a child forked from a process with gRPC threads: that child once died before it ran.)
CTRL_C_DEFAULT = ("import os, runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                  "sys.argv = sys.argv[1:]; sys.path.insert(0, os.path.dirname(sys.argv[0])); "
                  "runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "client-killed"])
def test_a_client_that_stops_or_dies_stops_the_generation(triton, how, tmp_path):
    """stream_grpc.py: Ctrl-C cancels the stream; a killed client closes it. Either way the work stops."""
    start = triton.metric(STEPS, model=STREAM)
    cancelled_before = triton.metric("neopp_failures_total", model=STREAM, **CANCELLED)
    kv = triton.checkpoint / "sample_kv"
    client = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_DEFAULT, str(REPO / "client_examples" / "stream_grpc.py"), "--url",
         triton.server.grpc_url,
         "--cond", str(kv / "cond_kv.pt"), "--uncond", str(kv / "uncond_kv.pt"), "--offset-cond", "24",
         "--offset-uncond", "7", "--size", "1024", "1024", "--steps", "200", "--seed", "4",
         "--out", str(tmp_path / "never.png")], stderr=subprocess.PIPE, cwd=REPO)
    try:
        seen, deadline = b"", time.monotonic() + 180
        while b"1/200" not in seen and time.monotonic() < deadline and client.poll() is None:
            seen += client.stderr.read(1)
        assert b"1/200" in seen, seen[-200:]
        client.send_signal(how)
        client.wait(timeout=60)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(timeout=30)
    cancelled = triton.wait_metric("neopp_failures_total", cancelled_before + 1, timeout=120, model=STREAM,
                                   **CANCELLED)
    assert cancelled == cancelled_before + 1, "the server never cancelled the stream of the gone client"
    assert 1 <= triton.metric(STEPS, model=STREAM) - start < 200
    assert not (tmp_path / "never.png").exists()
    if how == signal.SIGINT:
        assert client.returncode == 1 and b"cancelled by the user" in seen + client.stderr.read()


@pytest.mark.parametrize("overrides, message", [
    ({"PREVIEW_EVERY": np.array([-1], I64)}, "PREVIEW_EVERY: must be 0 (no previews) .. 200"),
    ({"PREVIEW_SIZE": np.array([0, 64], I64)}, "PREVIEW_SIZE: [height, width] must each be 1..1024"),
    ({"COND_KV": None}, "COND_KV: required input is missing"),
    ({"STEPS": np.array([0], I64)}, "STEPS: "),
])
def test_a_refused_request_gets_one_final_error_naming_the_input(triton, overrides, message):
    answers = stream(triton, STREAM, **overrides)
    assert len(answers) == 1
    result, error = answers[0]
    # a stream carries only the error's message (gRPC's stream response has no status field)
    assert result is None and error is not None
    assert error.message().startswith(message), error.message()


# ---------------------------------------------------------------- HTTP: generate_stream (SSE)

def _b64_kv(kv: torch.Tensor) -> str:
    return base64.b64encode(kv.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()).decode()


def sse(port: int, model: str, body: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """POST generate_stream; (status, [event JSON]) read as the events arrive."""
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=180)
    try:
        conn.request("POST", f"/v2/models/{model}/generate_stream", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        events = []
        while line := resp.readline():
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
        return resp.status, events
    finally:
        conn.close()


@pytest.fixture(scope="module")
def front(triton):
    """The launcher's HTTP door in front of the e2e server."""
    return triton.door.server_address[1]


def test_sse_through_the_front_streams_steps_previews_and_the_plain_image(triton, front):
    steps = 60
    body = {"COND_KV_B64": _b64_kv(triton.cond), "UNCOND_KV_B64": _b64_kv(triton.uncond),
            "INDEX_OFFSET_COND": COND_TOKENS, "INDEX_OFFSET_UNCOND": UNCOND_TOKENS, "SIZE": [64, 64],
            "STEPS": steps, "SEED": 31, "OUTPUT_FORMAT": "png", "PREVIEW_EVERY": 20, "BASE64_OUTPUT": 1}
    status, events = sse(front, STREAM, body)
    assert status == 200 and all("error" not in e for e in events), events[:1]
    assert [e["STEP"] for e in events] == [*range(1, steps + 1)]
    previews = [e["PREVIEW"] for e in events if "PREVIEW" in e]
    assert [e["STEP"] for e in events[:-1] if "PREVIEW" in e] == [20, 40]
    for text in previews:
        assert Image.open(io.BytesIO(base64.b64decode(text))).size == (64, 64)  # default: the image's own size
    want = plain(triton, "neopp_dense", SEED=np.array([31], I64), STEPS=np.array([steps], I64))
    last = events[-1]
    assert base64.b64decode(last["IMAGE"]) == want.as_numpy("IMAGE")[0]
    assert last["NEXT_RNG_STATE"] == want.as_numpy("NEXT_RNG_STATE").tolist()
    # That the front relays events as they come, not buffered to the end, is shown without timing
    # by the next test: it reads step 1 of a long generation and cancels the rest.


def test_closing_the_sse_connection_stops_the_generation(triton, front):
    start = triton.metric(STEPS, model=STREAM)
    cancelled_before = triton.metric("neopp_failures_total", model=STREAM, **CANCELLED)
    body = {"COND_KV_B64": _b64_kv(triton.cond), "UNCOND_KV_B64": _b64_kv(triton.uncond),
            "INDEX_OFFSET_COND": COND_TOKENS, "INDEX_OFFSET_UNCOND": UNCOND_TOKENS, "SIZE": [1024, 1024],
            "STEPS": 200, "SEED": 4}
    conn = http.client.HTTPConnection(LOOPBACK, front, timeout=180)
    conn.request("POST", f"/v2/models/{STREAM}/generate_stream", body=json.dumps(body))
    resp = conn.getresponse()
    assert json.loads(resp.readline()[6:])["STEP"] == 1
    conn.sock.close()  # the client leaves; the door cancels its gRPC call
    conn.close()
    cancelled = triton.wait_metric("neopp_failures_total", cancelled_before + 1, timeout=120, model=STREAM,
                                   **CANCELLED)
    assert cancelled == cancelled_before + 1, "Triton never cancelled the request of the closed connection"
    assert 1 <= triton.metric(STEPS, model=STREAM) - start < 200


def test_sse_refusal_and_bf16_json_limits(triton, front):
    body = {"COND_KV_B64": "not base64!", "INDEX_OFFSET_COND": COND_TOKENS, "CFG_SCALE": 1.0}
    status, events = sse(front, STREAM, body)
    assert status == 400 and len(events) == 1 and events[0]["error"].startswith("COND_KV_B64: must be base64")
    # what the base64 inputs are for: generate's JSON cannot carry the 5-D BF16 tensor itself
    body = {"COND_KV": triton.cond.float().tolist(), "INDEX_OFFSET_COND": COND_TOKENS, "CFG_SCALE": 1.0}
    conn = http.client.HTTPConnection(LOOPBACK, front, timeout=60)
    conn.request("POST", f"/v2/models/{STREAM}/generate_stream", body=json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 400 and "COND_KV" in json.loads(resp.read())["error"]
    conn.close()



def test_sse_field_naming_no_input_is_refused_not_ignored(triton, front):
    # generate_stream turns an unknown JSON field into a request parameter; a misspelt input must
    # not run silently without what it asked for
    body = {"COND_KV_B64": _b64_kv(triton.cond), "INDEX_OFFSET_COND": COND_TOKENS, "CFG_SCALE": 1.0,
            "SIZE": [64, 64], "STEPS": 2, "BASE64_OUTPUT": 1, "PREVIEW_EVRY": 1}
    status, events = sse(front, STREAM, body)
    assert status == 400 and len(events) == 1, events
    assert events[0]["error"].startswith("PREVIEW_EVRY: unknown input; expected names from"), events

def test_engine_histograms_on_the_metrics_port(triton):
    """The mode's engine (loaded by the plain twin, which the stream's requests run on) reports them."""
    assert final(stream(triton, STREAM, SEED=np.array([41], I64))[-1][0])
    text = urllib.request.urlopen(triton.server.metrics_url, timeout=10).read().decode()

    def value(name: str, **labels: str) -> float:
        want = {"model": "neopp_dense", **labels}
        for m in re.finditer(r"^(\w+)\{(.*)\} (\S+)$", text, re.M):
            if m.group(1) == name and dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))) == want:
                return float(m.group(3))
        raise AssertionError(f"no series {name}{want}")

    assert "# TYPE neopp_batch_step_seconds histogram" in text
    requests = value("neopp_queue_wait_seconds_count")
    steps = value("neopp_batch_step_seconds_count")
    assert requests >= 1 and steps >= 4 and value("neopp_batch_step_seconds_sum") > 0
    assert value("neopp_batch_size_count") == steps  # one observation per batched step
    assert value("neopp_batch_size_sum") >= steps  # each step runs at least one request
    assert value("neopp_queue_wait_seconds_bucket", le="+Inf") == requests
