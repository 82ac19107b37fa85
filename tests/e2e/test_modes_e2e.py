"""FP8, 8-step LoRA and MoE models through the real server."""

from __future__ import annotations

import io

import numpy as np
import pytest
from conftest import COND_TOKENS, E2E_MODELS, UNCOND_TOKENS, ensure_8steps_lora
from PIL import Image

from neopp.image_io import encode_image
from neopp.modes import load_mode
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing import REPO as REPO_ROOT
from testing.pictures import same_pixels

STEPS_METRIC = "neopp_denoising_steps_total"
MODES = REPO_ROOT / "configs" / "neopp"


def infer(triton, model: str, **overrides):
    return triton.grpc.infer(model, triton.grpc_tensors(**overrides), client_timeout=180.0)


def pixels(result) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(result.as_numpy("IMAGE")[0])).convert("RGB")).astype(int)


def in_process_png(ckpt, mode_file: str, triton, seed: int, steps: int | None, with_uncond: bool = True) -> bytes:
    pipe = NeoPPPipeline.from_pretrained(ckpt, load_mode(MODES / mode_file, lora_dir=ensure_8steps_lora().parent))
    sampling = pipe.mode.sampling_params.replace(infer_steps=steps, output_format="png")
    req = GenerationRequest(cond_kv=triton.cond, index_offset_cond=COND_TOKENS, height=64, width=64,
                            noise=NoiseStream(seed).draw(64, 64), sampling_params=sampling,
                            uncond_kv=triton.uncond if with_uncond else None,
                            index_offset_uncond=UNCOND_TOKENS if with_uncond else None)
    return encode_image(pipe.generate(req), "png")


@pytest.mark.parametrize("model", ["neopp_dense_fp8", "neopp_dense_8steps", "neopp_moe"])
def test_mode_answers_a_valid_request(triton, model):
    result = infer(triton, model, SEED=np.array([3], np.int64), SIZE=np.array([64, 96], np.int64))
    image = triton.image(result)
    assert image.format == "PNG" and image.size == (96, 64)
    assert pixels(result).std() > 5  # a real image, not a flat fill


def test_fp8_model_is_the_fp8_pipeline_and_close_to_dense(triton):
    seed = np.array([11], np.int64)
    fp8 = infer(triton, "neopp_dense_fp8", SEED=seed)
    dense = infer(triton, "neopp_dense", SEED=seed)
    in_process = in_process_png(triton.checkpoint, "neopp_dense_fp8.json", triton, 11, 4)
    assert same_pixels(fp8.as_numpy("IMAGE")[0], in_process)
    diff = np.abs(pixels(fp8) - pixels(dense))
    assert 0 < diff.mean() < 6.0  # quantised, within the bound of tests/test_fp8.py


def test_moe_model_matches_in_process(triton, tiny_moe):
    result = infer(triton, "neopp_moe", SEED=np.array([21], np.int64))
    assert same_pixels(result.as_numpy("IMAGE")[0], in_process_png(tiny_moe, "neopp_moe.json", triton, 21, 4))


def test_8steps_runs_8_steps_without_uncond_pass(triton):
    """Its STEPS default is 8 and CFG is off: sending UNCOND_KV changes nothing and costs nothing."""
    model, seed = "neopp_dense_8steps", np.array([5], np.int64)
    before = triton.metric(STEPS_METRIC, model=model)
    with_uncond = infer(triton, model, SEED=seed, STEPS=None)
    after_one = triton.wait_metric(STEPS_METRIC, before + 8, model=model)
    without = infer(triton, model, SEED=seed, STEPS=None, UNCOND_KV=None, INDEX_OFFSET_UNCOND=None)
    after_two = triton.wait_metric(STEPS_METRIC, before + 16, model=model)
    assert (after_one - before, after_two - after_one) == (8, 8)
    assert with_uncond.as_numpy("IMAGE")[0] == without.as_numpy("IMAGE")[0]
    png = in_process_png(triton.checkpoint, "neopp_dense_8steps.json", triton, 5, None, with_uncond=False)
    assert same_pixels(with_uncond.as_numpy("IMAGE")[0], png)  # the served model has the LoRA merged
    # and the LoRA matters: the plain dense model, same 8 unguided steps, gives another image
    plain = infer(triton, "neopp_dense", SEED=seed, STEPS=np.array([8], np.int64),
                  CFG_SCALE=np.array([1.0], np.float32))
    assert np.abs(pixels(plain) - pixels(with_uncond)).mean() > 1.0


def test_moe_cfg_equals_moe_for_the_same_seed(triton):
    """Two rank processes (cond on rank 0, uncond on rank 1) against the 1-process MoE model."""
    assert "neopp_moe_cfg" in E2E_MODELS
    for seed in (7, 8):
        overrides = dict(SEED=np.array([seed], np.int64), SIZE=np.array([64, 96], np.int64))
        cfg = infer(triton, "neopp_moe_cfg", **overrides)
        plain = infer(triton, "neopp_moe", **overrides)
        diff = np.abs(pixels(cfg) - pixels(plain))
        # same computation split over two ranks: equal up to float reassociation
        assert diff.max() <= 1, f"seed {seed}: max pixel difference {diff.max()}"
