"""The step cache through the real server: off is today's bytes, a cached request is the step
batcher's bytes in this process, and what a model does not offer is refused by name while the
server stays ready. (A cached request alone and in a batch, on every model that offers the cache:
test_batched_serving_e2e.)"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import COND_TOKENS, UNCOND_TOKENS
from tritonclient.utils import InferenceServerException

from neopp.image_io import encode_image
from neopp.modes import load_mode
from neopp.request import GenerationRequest
from neopp.sampling.batching import StepBatcher, start
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing import REPO as REPO_ROOT
from testing.pictures import same_pixels

I64, F32 = np.int64, np.float32
STEPS, SEED, THRESHOLD = 12, 11, 0.3


@pytest.fixture(scope="module")
def pipeline(tiny_dense):
    return NeoPPPipeline.from_pretrained(tiny_dense, load_mode(REPO_ROOT / "configs" / "neopp" / "neopp_dense.json"))


def request(triton, pipeline, **sampling) -> GenerationRequest:
    return GenerationRequest(cond_kv=triton.cond, uncond_kv=triton.uncond, index_offset_cond=COND_TOKENS,
                             index_offset_uncond=UNCOND_TOKENS, height=64, width=64,
                             noise=NoiseStream(SEED).draw(64, 64),
                             sampling_params=pipeline.mode.sampling_params.replace(
                                 infer_steps=STEPS, output_format="png", **sampling))


def batcher_png(pipeline, req: GenerationRequest) -> tuple[bytes, int]:
    """The request alone through this process's step batcher: its PNG and its reused passes."""
    a, batcher = start(pipeline, 0, req), StepBatcher(pipeline)
    while True:
        (event,) = batcher.step([a])
        if event.final is not None:
            return encode_image(event.final, "png"), a.cache.reused


def served(triton, model: str = "neopp_dense", **overrides) -> bytes:
    result = triton.grpc.infer(model, triton.grpc_tensors(SEED=np.array([SEED], I64), STEPS=np.array([STEPS], I64),
                                                          **overrides), client_timeout=180)
    return result.as_numpy("IMAGE")[0]


def test_cache_off_is_today_s_bytes(triton, pipeline):
    today = encode_image(pipeline.generate(request(triton, pipeline)), "png")
    assert same_pixels(served(triton), today)  # the served file adds its record
    assert served(triton, CACHE=np.array([b"off"], np.object_)) == served(triton)


@pytest.mark.parametrize("method", ["fbcache", "taylorseer"])
def test_a_cached_request_is_the_step_batcher_s_bytes(triton, pipeline, method):
    want, reused = batcher_png(pipeline, request(triton, pipeline, cache=method, cache_threshold=THRESHOLD))
    assert reused > 0  # the threshold really skips steps on these weights
    got = served(triton, CACHE=np.array([method.encode()], np.object_), CACHE_THRESHOLD=np.array([THRESHOLD], F32))
    assert same_pixels(got, want)
    assert not same_pixels(got, served(triton))  # and the cache changed the picture (a negative control)


@pytest.mark.parametrize("model,overrides,message", [
    ("neopp_dense_8steps", {"STEPS": None, "UNCOND_KV": None, "INDEX_OFFSET_UNCOND": None},
     "CACHE: 'fbcache' is not offered by this model (mode neopp_dense_8steps: its config parameter cache_methods"),
    ("neopp_dense_cfg_seq", {},
     "CACHE: 'fbcache' is not offered by this model (mode neopp_dense_parallel_cfg_seq: its Ulysses ranks"),
    ("neopp_dense", {"STEPS": np.array([6], I64)}, "CACHE: needs at least 10 steps, got 6"),
    ("neopp_dense", {"CACHE": np.array([b"magcache"], np.object_)}, "CACHE: unknown method 'magcache'"),
    ("neopp_dense", {"CACHE": None, "CACHE_THRESHOLD": np.array([0.2], F32)}, "CACHE_THRESHOLD: 0.2 given with"),
])
def test_what_a_model_does_not_offer_is_refused_by_name(triton, model, overrides, message):
    inputs = {"SEED": np.array([SEED], I64), "STEPS": np.array([STEPS], I64),
              "CACHE": np.array([b"fbcache"], np.object_), **overrides}
    with pytest.raises(InferenceServerException) as info:
        triton.grpc.infer(model, triton.grpc_tensors(**inputs), client_timeout=180)
    assert "INVALID_ARG" in str(info.value.status()) and message in info.value.message()
    assert triton.grpc.is_model_ready(model)
