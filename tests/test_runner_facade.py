"""neopp.runner.InProcessRunner, the stateful facade LightLLM calls: parameters, streams, KV loading."""

from __future__ import annotations

import io
from functools import partial

import numpy as np
import pytest
import torch
from PIL import Image

from neopp.errors import InputError
from neopp.model.kv_cache import save_kv_file
from neopp.modes import ModeSpec, SamplingParams
from neopp.runner import InProcessRunner
from neopp.sampling.rng import NoiseStream
from testing.tiny_checkpoint import random_kv, tiny_config, write_tiny_checkpoint
from tests.reference import neopp_reference as ref

kv = partial(random_kv, tiny_config("dense"), dtype=torch.float32)  # (tokens, seed) -> online-layout prefix

STEPS = 2
DEFAULT_SIZE = (64, 96)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("runner") / "dense", "dense", seed=0)


@pytest.fixture(scope="module")
def ref_model(ckpt):
    return ref.RefModel(ckpt)


COND, UNCOND = kv(12, 1), kv(4, 2)
OFF_C, OFF_U = 15, 3


def make_runner(ckpt, **kw):
    mode = ModeSpec(name="test", version="dense", default_size=DEFAULT_SIZE,
                    sampling_params=SamplingParams(infer_steps=STEPS, output_format="png"))
    runner = InProcessRunner(ckpt, mode, device="cpu", dtype=torch.float32, **kw)
    runner.set_kvcache(COND, UNCOND)
    runner.set_inference_params(OFF_C, OFF_U)
    return runner


def decode(data):
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def expected_pixels(ref_model, noise, H, W, cfg_scale=4.0, steps=STEPS, off_c=OFF_C, off_u=OFF_U):
    x = ref.reference_generate(ref_model, COND, UNCOND, off_c, off_u, H, W, noise, steps, 3.0, cfg_scale,
                               (-1.0, 2.0), "global", True)
    return ref.reference_pixels(x)


def close_pixels(got, want):
    diff = np.abs(got.astype(int) - want.astype(int))
    return diff.max() <= 1 and (diff > 0).mean() < 0.01


def test_seeded_generation_is_the_reference_image(ckpt, ref_model):
    runner = make_runner(ckpt)
    data = runner.generate(seed=200)
    img = decode(data)
    assert img.shape == (*DEFAULT_SIZE, 3)
    H, W = DEFAULT_SIZE
    assert close_pixels(img, expected_pixels(ref_model, NoiseStream(200).draw(H, W), H, W))
    # a wrong offset would have given a clearly different image
    wrong = expected_pixels(ref_model, NoiseStream(200).draw(H, W), H, W, off_c=OFF_C + 1)
    assert np.abs(img.astype(int) - wrong.astype(int)).mean() > 1.0
    assert make_runner(ckpt).generate(seed=200) == data


def test_seed_none_continues_the_stream(ckpt, ref_model):
    H, W = DEFAULT_SIZE
    a = make_runner(ckpt)
    turns = [a.generate(seed=200), a.generate(), a.generate()]
    assert len({*turns}) == 3
    # turn n without a seed uses the n-th draw of the seed-200 stream
    stream = NoiseStream(200)
    for data in turns:
        assert close_pixels(decode(data), expected_pixels(ref_model, stream.draw(H, W), H, W))
    # the same conversation replayed on another runner gives the same bytes
    b = make_runner(ckpt)
    assert [b.generate(seed=200), b.generate(), b.generate()] == turns
    # an explicit seed restarts the stream
    assert b.generate(seed=200) == turns[0]
    assert b.generate() == turns[1]


def test_target_shape_is_an_alias_of_size(ckpt):
    runner = make_runner(ckpt)
    by_size = runner.generate(seed=1, size=(96, 32))
    by_target = runner.generate(seed=1, target_shape=(96, 32))
    assert by_size == by_target
    assert decode(by_target).shape == (96, 32, 3)
    assert decode(runner.generate(seed=1)).shape == (*DEFAULT_SIZE, 3)


def test_per_call_task_does_not_change_the_default(ckpt):
    runner = make_runner(ckpt, default_task="i2i")
    t2i = runner.generate(seed=4, task="t2i")
    assert runner.default_task == "i2i"
    # t2i and i2i share one generation path
    assert runner.generate(seed=4) == t2i
    restricted = make_runner(ckpt, support_tasks=("t2i",))
    with pytest.raises(InputError, match="task"):
        restricted.generate(seed=4, task="i2i")
    assert restricted.default_task == "t2i"
    assert restricted.generate(seed=4) == t2i


@pytest.mark.parametrize("task", ["inpaint", "T2I", "t2v"])
def test_unsupported_task_is_refused(ckpt, task):
    with pytest.raises(InputError, match="task"):
        make_runner(ckpt).generate(seed=1, task=task)


@pytest.mark.parametrize("scale", [0.0, 1.5, 7.0])
def test_image_guidance_without_image_branch_is_refused(ckpt, scale):
    runner = make_runner(ckpt)
    with pytest.raises(InputError, match=r"^image_guidance_scale: .* refused without the image branch"):
        runner.set_inference_params(OFF_C, OFF_U, image_guidance_scale=scale)
        runner.generate(seed=1)
    runner.set_inference_params(OFF_C, OFF_U, image_guidance_scale=1.0)
    assert runner.generate(seed=1) == make_runner(ckpt).generate(seed=1)


def test_save_result_path_writes_the_file(ckpt, tmp_path):
    runner = make_runner(ckpt)
    path = tmp_path / "out.png"
    data = runner.generate(seed=9, save_result_path=str(path))
    assert path.read_bytes() == data and Image.open(path).format == "PNG"


def test_guidance_without_uncond_is_refused(ckpt):
    runner = make_runner(ckpt)
    runner.set_kvcache(COND)
    with pytest.raises(InputError, match="(?i)uncond"):
        runner.generate(seed=1)
    # no step uses guidance: no uncond needed
    runner.set_inference_params(OFF_C, enable_cfg=False)
    runner.generate(seed=1)
    runner = make_runner(ckpt)
    runner.set_kvcache(COND)
    runner.set_inference_params(OFF_C, cfg_interval=(2.0, 3.0))
    runner.generate(seed=1)


def test_omitted_params_keep_the_runner_defaults(ckpt, ref_model):
    """A call's set_inference_params values override the mode's for that call; fields it omits
    keep the runner's defaults, so an override does not leak into a later call that omits it."""
    H, W = DEFAULT_SIZE
    runner = make_runner(ckpt)
    runner.set_inference_params(OFF_C, OFF_U, cfg_scale=1.0)
    no_guidance = decode(runner.generate(seed=5))
    assert close_pixels(no_guidance, expected_pixels(ref_model, NoiseStream(5).draw(H, W), H, W, cfg_scale=1.0))
    runner.set_inference_params(OFF_C, OFF_U)  # cfg_scale omitted: back to the mode's 4.0
    again = decode(runner.generate(seed=5))
    assert not np.array_equal(again, no_guidance), "cfg_scale=1.0 of the previous call leaked into this one"
    assert close_pixels(again, expected_pixels(ref_model, NoiseStream(5).draw(H, W), H, W, cfg_scale=4.0))


def test_output_format_and_resize_params(ckpt):
    runner = make_runner(ckpt)
    runner.set_inference_params(OFF_C, OFF_U, output_format="webp", resize=(50, 70))
    img = Image.open(io.BytesIO(runner.generate(seed=2)))
    assert img.format == "WEBP" and img.size == (70, 50)
    with pytest.raises(InputError, match="output_format"):
        runner.set_inference_params(OFF_C, OFF_U, output_format="bmp")


def test_load_kvcache_from_replay_files(ckpt, tmp_path):
    save_kv_file(COND, tmp_path / "cond.pt", "replay")
    torch.save(UNCOND.transpose(2, 3).cpu(), tmp_path / "uncond.pt")  # how LightLLM writes replay files
    runner = make_runner(ckpt)
    runner.load_kvcache(tmp_path / "cond.pt", tmp_path / "uncond.pt")
    assert runner.generate(seed=3) == make_runner(ckpt).generate(seed=3)


def test_generate_before_kv_is_refused(ckpt):
    mode = ModeSpec(name="test", version="dense", sampling_params=SamplingParams(infer_steps=STEPS))
    runner = InProcessRunner(ckpt, mode, device="cpu", dtype=torch.float32)
    with pytest.raises(InputError):
        runner.generate(seed=1)


def test_unknown_cfg_norm_is_an_input_error(ckpt):
    runner = make_runner(ckpt)
    with pytest.raises(InputError, match="cfg_norm"):
        runner.set_inference_params(OFF_C, OFF_U, cfg_norm="l2")
