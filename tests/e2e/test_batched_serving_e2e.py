"""Every generation model batches, through the real server: a request's bytes are its solo bytes.

For each model a long request runs first (512x512, 200 steps: the engine is busy with it for a
long while); then requests that differ in size, steps, guidance (on, off, over an interval), seed,
prefix and task (editing with the image branch) are sent at once. The engine's own count of its
steps by batch size must show steps that ran several requests (a one-at-a-time path never does),
and each image must be the PNG its request gives when sent alone.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import E2E_MODELS

from testing.faults import _series
from testing.tiny_checkpoint import random_kv, tiny_config

GENERATION = [m for m in E2E_MODELS if m != "neopp_session" and not m.endswith("_stream")]
STEPS_METRIC = "neopp_denoising_steps_total"
I64, F32 = np.int64, np.float32


def mixed_requests(model: str) -> list[dict]:
    """Overrides of the suite's valid request (64x64, 4 steps, guided, PNG). The 8-step mode guides
    nothing (its editing request keeps image guidance at 1)."""
    image_kv = random_kv(tiny_config("dense"), 15, seed=5).float().numpy()
    image_scale = 1.0 if model == "neopp_dense_8steps" else 2.0
    return [
        {"SEED": np.array([1], I64)},
        {"SEED": np.array([2], I64), "SIZE": np.array([96, 64], I64), "STEPS": np.array([3], I64)},
        {"SEED": np.array([3], I64), "CFG_SCALE": np.array([1.0], F32)},  # guidance off
        {"SEED": np.array([4], I64), "CFG_INTERVAL": np.array([0.3, 0.8], F32), "STEPS": np.array([5], I64)},
        {"SEED": np.array([5], I64), "UNCOND_KV": None, "INDEX_OFFSET_UNCOND": None,
         "CFG_SCALE": np.array([1.0], F32), "INDEX_OFFSET_COND": np.array([11], I64)},  # another prefix
        {"SEED": np.array([6], I64), "IMAGE_KV": (image_kv, "BF16"), "INDEX_OFFSET_IMAGE": np.array([15], I64),
         "IMAGE_GUIDANCE_SCALE": np.array([image_scale], F32), "TASK": np.array([b"i2i"], np.object_)},  # editing
        *cached_requests(model),
    ]


def cached_requests(model: str) -> list[dict]:
    """Requests with a step cache, on the models that offer one (not the 8-step or Ulysses ones): each
    reuses on some steps (threshold 0.3 on the tiny weights) and decides from its own state alone."""
    if model in ("neopp_dense_8steps", "neopp_dense_cfg_seq"):
        return []
    return [{"SEED": np.array([7], I64), "STEPS": np.array([12], I64), "CACHE": np.array([method], np.object_),
             "CACHE_THRESHOLD": np.array([0.3], F32)} for method in (b"fbcache", b"taylorseer")]


def image(result) -> bytes:
    return result.as_numpy("IMAGE")[0]


def shared_steps(triton, model: str) -> float:
    """Steps of ``model``'s engine that ran more than one request (its batch-size histogram)."""
    series = [(n, labels, v) for n, labels, v in _series(triton.server.metrics_url)
              if labels.get("model") == model and n.startswith("neopp_batch_size")]
    total = sum(v for n, _, v in series if n == "neopp_batch_size_count")
    alone = sum(v for n, labels, v in series if n == "neopp_batch_size_bucket" and float(labels["le"]) == 1.0)
    return total - alone


@pytest.mark.parametrize("model", GENERATION)
def test_concurrent_requests_share_steps_and_equal_their_solo_bytes(triton, model):
    requests = mixed_requests(model)
    solo = [image(triton.grpc.infer(model, triton.grpc_tensors(**r), client_timeout=180)) for r in requests]

    long_done = threading.Event()
    long_outcome: dict = {}

    def on_long(result, error) -> None:
        long_outcome["error"] = error
        long_done.set()

    before, shared_before = triton.metric(STEPS_METRIC, model=model), shared_steps(triton, model)
    long = triton.grpc.async_infer(model, triton.grpc_tensors(STEPS=np.array([200], I64), SEED=np.array([9], I64),
                                                              SIZE=np.array([512, 512], I64)), on_long)
    try:
        assert triton.wait_metric(STEPS_METRIC, before + 1, timeout=120, model=model) >= before + 1, "no step ran"
        got: dict[int, bytes] = {}
        errors: list = []

        def one(i: int) -> None:
            client = grpcclient.InferenceServerClient(triton.server.grpc_url)
            try:
                got[i] = image(client.infer(model, triton.grpc_tensors(**requests[i]), client_timeout=180))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append((i, exc))
            finally:
                client.close()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        assert shared_steps(triton, model) > shared_before, f"no step ran two requests at once ({long_outcome})"
        assert long_outcome.get("error") is None, long_outcome
        for i, want in enumerate(solo):
            assert got[i] == want, f"request {i} of {model}: batched bytes differ from solo"
    finally:
        long.cancel()
        long_done.wait(timeout=120)
