"""The LightX2V facade as LightLLM drives it: call sequence, RNG contract, hooks, config lock.

The facade must behave like LightX2V where LightLLM depends on it (global-RNG seeding and
restore, hook points, locked config) and compute what the pipeline computes (checked against
the independent reference).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import random
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from neopp.compat.lightx2v import LightX2VPipeline
from neopp.compat.lightx2v_config import LockedConfig, mode_of
from neopp.errors import ConfigError, InputError
from testing import REPO
from testing.lightllm_adapter import AdapterCopy, patch_runner_class, scenario, unpatch_runner_class
from testing.tiny_checkpoint import random_kv, tiny_config, write_tiny_checkpoint
from tests.reference import neopp_reference as ref

pytestmark = pytest.mark.usefixtures("one_thread")
kv = partial(random_kv, tiny_config("dense"))  # bf16 online layout, as LightLLM hands it over
COND, UNCOND, IMAGE = kv(12, 1), kv(5, 2), kv(9, 3)
DENSE = str(REPO / "configs" / "neopp" / "neopp_dense.json")
CFG2 = str(REPO / "configs" / "neopp" / "neopp_dense_parallel_cfg.json")
STEPS = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("facade") / "dense", "dense", seed=0)


@pytest.fixture(scope="module")
def short_mode(tmp_path_factory) -> str:
    """The dense mode file with few steps (LightLLM passes whatever JSON the deployment names)."""
    path = tmp_path_factory.mktemp("modes") / "neopp_dense_short.json"
    path.write_text(Path(DENSE).read_text().replace('"infer_steps": 50', f'"infer_steps": {STEPS}'))
    return str(path)


@pytest.fixture
def lightllm_patches():
    saved = patch_runner_class()
    yield
    unpatch_runner_class(saved)


def make_pipe(ckpt, mode, **kw) -> LightX2VPipeline:
    pipe = LightX2VPipeline(model_path=str(ckpt), model_cls="neopp", support_tasks=["t2i", "i2i"], **kw)
    pipe.create_generator(config_json=mode, device="cpu", dtype="float32")
    pipe.modify_config({"save_result_for_debug": False})
    return pipe


def run(pipe, seed=None, size=(64, 96), **params) -> bytes:
    pipe.runner.set_inference_params(index_offset_cond=12, index_offset_uncond=5, output_format="png", **params)
    pipe.runner.set_kvcache(COND, UNCOND)
    return base64.b64decode(pipe.generate(seed=seed, save_result_path="", target_shape=list(size)))


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_interleaved_sessions_continue_exactly_as_uninterrupted(ckpt, short_mode, lightllm_patches):
    """LightLLM's save/restore of the global RNG: B's seeding between A's images changes nothing for A."""
    images = {}
    adapter = AdapterCopy(str(ckpt), short_mode)
    for name, param in scenario({"cond": COND, "uncond": UNCOND, "image": IMAGE}):
        images[name] = base64.b64decode(adapter.process(param)[0])
    alone = AdapterCopy(str(ckpt), short_mode)
    steps = dict(scenario({"cond": COND, "uncond": UNCOND, "image": IMAGE}))
    uninterrupted = [base64.b64decode(alone.process(steps[n])[0]) for n in ("a0", "a1")]
    assert [images["a0"], images["a1"]] == uninterrupted
    assert images["a1"] != images["a0"]  # the second image continues the stream, it does not repeat it
    assert pixels(images["a1"]).shape == (48, 80, 3)  # set_resolution went through LightLLM's own hook
    assert images["b0"][:3] == b"\xff\xd8\xff"  # output_format jpeg
    one_scale = dataclasses.replace(steps["c0"], image_guidance_scale=1.0, session_id=4)
    assert base64.b64decode(alone.process(one_scale)[0]) != images["c0"]  # the image scale is honoured


def test_an_integer_seed_draws_lightx2vs_noise_from_the_global_generators(ckpt, short_mode):
    pipe = make_pipe(ckpt, short_mode)
    run(pipe, seed=321)
    sched = pipe.runner.scheduler
    torch.manual_seed(321)
    expected = sched.noise_scale * torch.randn((1, 3, 64, 96), dtype=torch.bfloat16)
    assert sched.latents.dtype == torch.bfloat16 and torch.equal(sched.latents, expected)
    random_next, numpy_next = random.random(), np.random.random()
    random.seed(321)
    np.random.seed(321)
    assert (random_next, numpy_next) == (random.random(), np.random.random())
    assert os.environ["PYTHONHASHSEED"] == "321"


def test_seed_none_continues_whatever_global_state_the_caller_set(ckpt, short_mode):
    pipe = make_pipe(ckpt, short_mode)
    seeded = run(pipe, seed=5)
    torch.manual_seed(5)
    assert run(pipe, seed=None) == seeded
    state = torch.get_rng_state()
    second = run(pipe, seed=None)
    torch.set_rng_state(state)
    assert run(pipe, seed=None) == second != seeded


def test_the_image_is_the_reference_image_for_the_drawn_start(ckpt, short_mode):
    pipe = make_pipe(ckpt, short_mode)
    data = run(pipe, seed=9)
    sched = pipe.runner.scheduler
    unscaled = sched.latents.double() / sched.noise_scale  # the reference applies the scale itself
    x = ref.reference_generate(ref.RefModel(ckpt), COND.float(), UNCOND.float(), 12, 5, 64, 96, unscaled,
                               STEPS, 3.0, 4.0, (-1.0, 2.0), "global", True)
    diff = np.abs(pixels(data).astype(int) - ref.reference_pixels(x).astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01  # float32 vs float64: a rounding step at most


def test_hooks_see_every_step_and_a_raising_step_hook_stops_the_generation(ckpt, short_mode):
    pipe = make_pipe(ckpt, short_mode)
    calls = []
    pipe.runner._run_infer_step = lambda k, n: calls.append((k, n))
    pipe.runner.process_images_after_vae_decoder = lambda: "whatever the hook returns"
    pipe.runner.set_inference_params(index_offset_cond=12, index_offset_uncond=5)
    pipe.runner.set_kvcache(COND, UNCOND)
    assert pipe.generate(seed=1, save_result_path="", target_shape=[64, 64]) == "whatever the hook returns"
    assert calls == [(k, STEPS) for k in range(STEPS)]

    class Aborted(Exception):
        pass

    def abort_at_two(k, n):
        calls.append((k, n))
        if k == 2:
            raise Aborted("request cancelled by the caller")

    calls.clear()
    pipe.runner._run_infer_step = abort_at_two
    pipe.runner.set_kvcache(COND, UNCOND)
    with pytest.raises(Aborted, match="cancelled by the caller"):
        pipe.generate(seed=1, save_result_path="", target_shape=[64, 64])
    assert calls == [(0, STEPS), (1, STEPS), (2, STEPS)]
    assert pipe.runner.past_key_values_cond is None  # cleared even after a failure, as LightX2V does


def test_the_config_locks_and_modify_config_still_works(ckpt, short_mode):
    pipe = make_pipe(ckpt, short_mode)
    config = pipe.runner.config
    config.lock()
    with pytest.raises(ConfigError, match="locked"):
        config["save_result_for_debug"] = True
    with config.temporarily_unlocked():
        config["anything"] = 1
    assert config.locked
    pipe.modify_config({"save_result_for_debug": True})
    assert config["save_result_for_debug"] is True and config.locked
    assert config["task"] == "t2i" and "support_tasks" not in config


def test_debug_saving_writes_the_file_and_returns_the_image(ckpt, short_mode, tmp_path):
    pipe = make_pipe(ckpt, short_mode)
    pipe.modify_config({"save_result_for_debug": True})
    pipe.runner.set_inference_params(index_offset_cond=12, index_offset_uncond=5)
    pipe.runner.set_kvcache(COND, UNCOND)
    image = pipe.generate(seed=3, save_result_path=str(tmp_path / "out.png"), target_shape=[64, 64])
    assert image.size == (64, 64) and (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"


def test_omitted_parameters_keep_the_modes_values(ckpt, short_mode):
    pipe = make_pipe(ckpt, short_mode)
    pipe.runner.set_inference_params(index_offset_cond=12, index_offset_uncond=5, cfg_scale=2.0)
    first = pipe.runner.sampling_params
    assert (first.cfg_scale, first.cfg_norm, first.infer_steps, first.timestep_shift) == (2.0, "global", STEPS, 3.0)
    pipe.runner.set_inference_params(index_offset_cond=12, index_offset_uncond=5, infer_steps=2)
    assert (pipe.runner.sampling_params.cfg_scale, pipe.runner.sampling_params.infer_steps) == (4.0, 2)
    with pytest.raises(InputError, match="cfg_norm"):
        pipe.runner.set_inference_params(index_offset_cond=12, cfg_norm="sideways")


def test_what_neopp_cannot_use_is_refused_not_dropped(ckpt, short_mode):
    with pytest.raises(ConfigError, match="model_cls"):
        LightX2VPipeline(model_path=str(ckpt), model_cls="wan2.1")
    pipe = make_pipe(ckpt, short_mode)
    pipe.runner.set_inference_params(index_offset_cond=12, index_offset_uncond=5)
    for kwargs, name in (({"prompt": "a cat"}, "prompt"), ({"image_path": "in.png"}, "image_path"),
                         ({"task": "t2v"}, "task"), ({"seed": -1}, "seed")):
        pipe.runner.set_kvcache(COND, UNCOND)
        with pytest.raises(InputError, match=name):
            pipe.generate(save_result_path="", target_shape=[64, 64], **kwargs)
    state = torch.get_rng_state()
    pipe.runner.set_kvcache(COND, UNCOND)
    with pytest.raises(InputError, match="size"):
        pipe.generate(seed=None, save_result_path="", target_shape=[60, 64])
    assert torch.equal(state, torch.get_rng_state())  # refused before the draw


def test_a_parallel_mode_without_torchrun_runs_on_a_rank_pool_and_matches(ckpt, short_mode, tmp_path):
    cfg2 = tmp_path / "neopp_dense_parallel_cfg.json"
    cfg2.write_text(Path(CFG2).read_text().replace('"infer_steps": 50', f'"infer_steps": {STEPS}'))
    one, two = make_pipe(ckpt, short_mode), make_pipe(ckpt, str(cfg2))
    try:
        a, b = run(one, seed=4), run(two, seed=4)
    finally:
        two.close()
    diff = np.abs(pixels(a).astype(int) - pixels(b).astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01  # CFG ranks reassociate float sums


def test_lightllms_sequence_under_torchrun_matches_one_process(ckpt, short_mode, tmp_path):
    """LightLLM starts one x2v process per rank; each runs the same calls on its ParallelPipeline."""
    cfg2 = tmp_path / "neopp_dense_parallel_cfg.json"
    cfg2.write_text(Path(CFG2).read_text().replace('"infer_steps": 50', f'"infer_steps": {STEPS}'))
    prefixes = {"cond": COND, "uncond": UNCOND, "image": IMAGE}
    save_file({k: v.contiguous() for k, v in prefixes.items()}, str(tmp_path / "kv.safetensors"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    common = ["-m", "testing.lightllm_adapter", "--model-path", str(ckpt), "--kv", str(tmp_path / "kv.safetensors")]
    one = subprocess.run([sys.executable, *common, "--config-json", short_mode, "--out-dir", str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          *common, "--config-json", str(cfg2), "--out-dir", str(tmp_path / "two")],
                         capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert two.returncode == 0, two.stderr[-3000:]
    for name in ("a0", "b0", "a1", "b1", "c0"):
        a, b = (pixels((tmp_path / d / f"{name}.bin").read_bytes()).astype(int) for d in ("one", "two"))
        assert a.shape == b.shape
        assert np.abs(a - b).max() <= 2, name  # reassociation, and b0 is a JPEG


def test_enable_calls_set_the_mode_and_the_json_wins_as_in_lightx2v(ckpt, short_mode, tmp_path):
    pipe = LightX2VPipeline(model_path=str(ckpt), model_cls="neopp")
    pipe.enable_quantize(dit_quantized=True, quant_scheme="fp8-sgl")
    pipe.enable_lora([{"path": str(tmp_path / "x.safetensors"), "strength": 0.5}])
    pipe.enable_parallel(cfg_p_size=2)
    raw = Path(short_mode).read_text().replace('"enable_cfg": true', '"enable_cfg": true, "parallel": {}')
    (tmp_path / "m.json").write_text(raw)
    config = LockedConfig({**pipe.settings, **json.loads(raw)})
    mode = mode_of(config, "m", tmp_path, None)
    assert mode.dit_quantized and mode.dit_quant_scheme == "fp8-sgl"
    assert mode.lora_configs[0]["strength"] == 0.5
    assert mode.world_size == 1  # the JSON's "parallel" replaced enable_parallel's, as LightX2V's update does
    with pytest.raises(ConfigError, match="dit_quantized_ckpt"):
        pipe.enable_quantize(dit_quantized=True, dit_quantized_ckpt="/x")
