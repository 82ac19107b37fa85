"""The LightX2V facade over Triton: LightLLM's call sequence gives the in-process bytes, NOISE's rules."""

from __future__ import annotations

import base64
import time

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from neopp.compat.lightx2v import LightX2VPipeline
from testing import REPO
from testing.lightllm_adapter import AdapterCopy, patch_runner_class, scenario, unpatch_runner_class
from testing.tiny_checkpoint import random_kv, tiny_config

DENSE = str(REPO / "configs" / "neopp" / "neopp_dense.json")


@pytest.fixture
def lightllm_patches():
    saved = patch_runner_class()
    yield
    unpatch_runner_class(saved)


def images(adapter: AdapterCopy, kv: dict) -> dict[str, bytes]:
    try:
        return {name: base64.b64decode(adapter.process(param)[0]) for name, param in scenario(kv)}
    finally:
        adapter.pipe.close()


def test_lightllms_sequence_gives_the_same_bytes_in_process_and_over_triton(triton, lightllm_patches):
    kv = {"cond": triton.cond, "uncond": triton.uncond, "image": random_kv(tiny_config("dense"), 9, 3)}
    local = images(AdapterCopy(str(triton.checkpoint), DENSE), kv)
    remote = images(AdapterCopy(str(triton.checkpoint), DENSE, server_url=triton.server.grpc_url,
                                triton_model="neopp_dense"), kv)
    assert remote == local
    assert len(set(local.values())) == 5  # c0 edits with the image branch (three-branch guidance)


def test_a_step_hook_that_raises_cancels_the_remote_request(triton):
    pipe = LightX2VPipeline(model_path=str(triton.checkpoint), model_cls="neopp", server_url=triton.server.grpc_url)
    pipe.create_generator(config_json=DENSE)
    pipe.modify_config({"save_result_for_debug": False})

    def stop_soon(k, n):
        if k >= 1:
            raise KeyboardInterrupt("client went away")

    pipe.runner._run_infer_step = stop_soon
    pipe.runner.set_inference_params(index_offset_cond=24, index_offset_uncond=7, infer_steps=200)
    pipe.runner.set_kvcache(triton.cond, triton.uncond)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match="client went away"):
        pipe.generate(seed=1, save_result_path="", size=[256, 256])
    assert time.monotonic() - start < 60
    pipe.close()
    assert triton.image(triton.infer_grpc(SEED=np.array([3], np.int64))).size == (64, 64)


@pytest.mark.parametrize("noise, extra, message", [
    (np.zeros((1, 3, 64, 32), np.float32), {}, "NOISE: shape must be [1, 3, 64, 64]"),
    (np.full((1, 3, 64, 64), np.nan, np.float32), {}, "NOISE: must be finite"),
    (np.full((1, 3, 64, 64), 5e3, np.float32), {}, "NOISE: values must lie within"),
    (np.zeros((1, 3, 64, 64), np.float32), {"SEED": np.array([1], np.int64)}, "not both SEED and NOISE"),
])
def test_noise_is_validated_and_the_server_stays_ready(triton, noise, extra, message):
    with pytest.raises(InferenceServerException) as info:
        triton.infer_grpc(NOISE=noise, **extra)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and message in info.value.message(), info.value
    assert triton.image(triton.infer_grpc(SEED=np.array([3], np.int64))).size == (64, 64)


def test_the_same_noise_gives_the_same_image_and_leaves_the_stream_alone(triton):
    noise = np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32)
    a, b = triton.infer_grpc(NOISE=noise), triton.infer_grpc(NOISE=noise)
    assert a.as_numpy("IMAGE")[0] == b.as_numpy("IMAGE")[0]
    assert a.as_numpy("NEXT_RNG_STATE").tobytes() == b.as_numpy("NEXT_RNG_STATE").tobytes()
    assert a.as_numpy("IMAGE")[0] != triton.infer_grpc(NOISE=noise * 0.5).as_numpy("IMAGE")[0]
