"""Cancellation and custom metrics, observed on the metrics port (no sleeping on guesses)."""

from __future__ import annotations

import http.client
import queue

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from neopp.ports import LOOPBACK

I64 = np.int64
STEPS = "neopp_denoising_steps_total"
CANCELLED = {"reason": "cancelled"}
# Big enough that the whole request takes many seconds on a small CPU; it never runs to the end.
LONG = dict(SIZE=np.array([1024, 1024], I64), STEPS=np.array([200], I64), SEED=np.array([4], I64))


def _cancelled_early(triton, start_steps: float, cancelled_before: float, min_steps: int = 1) -> float:
    """Wait (bounded) until the model reports the cancellation; return the steps it ran."""
    cancelled = triton.wait_metric("neopp_failures_total", cancelled_before + 1, **CANCELLED)
    assert cancelled == cancelled_before + 1, "the model never observed the cancellation"
    ran = triton.metric(STEPS) - start_steps
    assert min_steps <= ran < 200, f"cancelled request ran {ran} of 200 steps"
    return ran


def _next_request_runs_alone(triton, start_steps: float, ran: float) -> None:
    """A valid request succeeds, and its 4 steps are the only ones after the cancellation."""
    assert triton.image(triton.infer_grpc(SEED=np.array([1], I64))).size == (64, 64)
    assert triton.metric(STEPS) == start_steps + ran + 4, "the cancelled generation kept stepping"


def test_client_cancel_stops_generation_between_steps(triton):
    start, cancelled_before = triton.metric(STEPS), triton.metric("neopp_failures_total", **CANCELLED)
    answers: queue.Queue = queue.Queue()
    call = triton.grpc.async_infer("neopp_dense", triton.grpc_tensors(**LONG),
                                   callback=lambda result, error: answers.put((result, error)))
    assert triton.wait_metric(STEPS, start + 2) >= start + 2, "generation did not start"
    call.cancel()
    result, error = answers.get(timeout=60)
    assert result is None and "CANCELLED" in str(error.status())
    ran = _cancelled_early(triton, start, cancelled_before)
    _next_request_runs_alone(triton, start, ran)


def test_http_client_that_hangs_up_stops_generation(triton):
    """Over HTTP too: the door sends the request to Triton over gRPC and cancels it when its
    client's connection closes."""
    start, cancelled_before = triton.metric(STEPS), triton.metric("neopp_failures_total", **CANCELLED)
    tensors = []
    for name, (array, dtype) in triton.inputs(**LONG).items():
        tensor = httpclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array, binary_data=True)
        tensors.append(tensor)
    body, header_length = httpclient.InferenceServerClient.generate_request_body(tensors)
    conn = http.client.HTTPConnection(LOOPBACK, triton.door.server_address[1], timeout=60)
    conn.request("POST", "/v2/models/neopp_dense/infer", body=body,
                 headers={"Inference-Header-Content-Length": str(header_length)})
    assert triton.wait_metric(STEPS, start + 2) >= start + 2, "generation did not start"
    conn.sock.close()  # the client hangs up without reading an answer
    conn.close()
    ran = _cancelled_early(triton, start, cancelled_before)
    _next_request_runs_alone(triton, start, ran)


def test_client_timeout_stops_generation(triton):
    """The deadline is what stops it: on a busy machine it may pass before the first step ends,
    so no step count is required, only that the model saw the cancellation and stopped early."""
    start, cancelled_before = triton.metric(STEPS), triton.metric("neopp_failures_total", **CANCELLED)
    with pytest.raises(InferenceServerException) as info:
        triton.infer_grpc(timeout=5.0, **LONG)
    assert "DEADLINE_EXCEEDED" in str(info.value.status())
    ran = _cancelled_early(triton, start, cancelled_before, min_steps=0)
    _next_request_runs_alone(triton, start, ran)


def test_custom_metrics_appear_and_move(triton):
    names = ("neopp_generations_total", STEPS, "neopp_generation_seconds_total", "neopp_step_seconds_total")
    before = {n: triton.metric(n) for n in names}
    triton.infer_grpc(STEPS=np.array([3], I64), SEED=np.array([2], I64))
    after = {n: triton.metric(n) for n in names}
    assert after["neopp_generations_total"] == before["neopp_generations_total"] + 1
    assert after[STEPS] == before[STEPS] + 3
    assert after["neopp_generation_seconds_total"] > before["neopp_generation_seconds_total"]
    assert after["neopp_step_seconds_total"] > before["neopp_step_seconds_total"]
    assert after["neopp_generation_seconds_total"] - before["neopp_generation_seconds_total"] >= \
        after["neopp_step_seconds_total"] - before["neopp_step_seconds_total"]

    invalid = triton.metric("neopp_failures_total", reason="invalid_input")
    with pytest.raises(InferenceServerException):
        triton.infer_grpc(SIZE=np.array([33, 64], I64))
    assert triton.metric("neopp_failures_total", reason="invalid_input") == invalid + 1
    assert triton.metric("neopp_generations_total") == after["neopp_generations_total"]
