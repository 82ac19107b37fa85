"""Seeded malformed requests over gRPC and HTTP (600 in all): each is refused as the client's
fault with a message naming the input; after every batch the server is ready and a valid
request returns the same bytes as before the batch."""

from __future__ import annotations

import time

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from neopp.limits import Limits
from testing.fuzz import generate_cases
from testing.loadgen import image_bytes, infer, valid_inputs

MODEL = "neopp_dense"
PER_PROTOCOL, BATCH = 300, 50
SEEDS = {"grpc": 8101, "http": 8102}  # fixed: a failing case can be replayed by its label
REFUSED = {"grpc": "StatusCode.INVALID_ARGUMENT", "http": "400"}


def model_limits(triton) -> Limits:
    """The limits neopp_dense was configured with (config.pbtxt parameters)."""
    params = triton.grpc.get_model_config(MODEL, as_json=True)["config"].get("parameters", {})
    return Limits.from_params({k: v["string_value"] for k, v in params.items()})


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_malformed_requests_are_refused_naming_the_input(triton, protocol):
    client = triton.grpc if protocol == "grpc" else triton.http
    cond, uncond = triton.cond.float().numpy(), triton.uncond.float().numpy()
    valid = valid_inputs(cond, uncond, (24, 7), seed=5)
    reference = image_bytes(infer(client, MODEL, valid))
    kv_dims = (cond.shape[0], cond.shape[3], cond.shape[4])
    failures, kinds, started = [], set(), time.monotonic()
    for i, case in enumerate(generate_cases(PER_PROTOCOL, SEEDS[protocol], kv_dims, model_limits(triton))):
        kinds.add(case.label.split(":", 1)[1])
        try:
            infer(client, MODEL, case.inputs, timeout=60)
            failures.append(f"{case.label}: accepted")
        except InferenceServerException as exc:
            message = exc.message() or ""
            if exc.status() != REFUSED[protocol]:
                failures.append(f"{case.label}: status {exc.status()}: {message[:200]}")
            elif not any(name in message for name in case.names):
                failures.append(f"{case.label}: message does not name {case.names}: {message[:200]}")
        if (i + 1) % BATCH == 0:
            assert client.is_server_ready() and client.is_model_ready(MODEL), f"not ready after case {i}"
            assert image_bytes(infer(client, MODEL, valid)) == reference, f"valid request changed after case {i}"
    assert not failures, f"{len(failures)} of {PER_PROTOCOL} cases:\n" + "\n".join(failures[:30])
    assert len(kinds) >= 30, sorted(kinds)
    assert time.monotonic() - started < 240


def test_fuzz_cases_are_reproducible():
    """Same seed, same requests (so a failure can be replayed)."""
    a = list(generate_cases(40, 1, (2, 2, 32), over_limit_every=1000))
    b = list(generate_cases(40, 1, (2, 2, 32), over_limit_every=1000))
    assert [c.label for c in a] == [c.label for c in b]
    for x, y in zip(a, b):
        assert x.inputs.keys() == y.inputs.keys()
        for name in x.inputs:
            ax, ay = x.inputs[name][0], y.inputs[name][0]
            assert ax.dtype == ay.dtype and ax.shape == ay.shape
            assert np.array_equal(ax, ay, equal_nan=ax.dtype.kind == "f")
