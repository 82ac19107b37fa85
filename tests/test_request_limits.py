"""Extreme request values are refused as the request's fault (InputError naming the input) before
anything is built from them, echoed strings stay short, and a state that stops being finite fails
the generation instead of decoding to a flat image."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neopp.errors import InputError, NonFiniteState, shown
from neopp.limits import Limits
from neopp.modes import SamplingParams
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.plan import StepPlan, step_plan
from neopp.sampling.sampler import check_finite
from neopp.sampling.schedule import shifted_timesteps
from neopp.serving.request_parsing import parse_request
from testing.tiny_checkpoint import write_tiny_checkpoint

I64, F32 = np.int64, np.float32
INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)  # about 3.39e38


def _inputs(**overrides):
    base = {
        "COND_KV": torch.zeros(2, 2, 3, 1, 4, dtype=torch.bfloat16),
        "INDEX_OFFSET_COND": np.array([3], I64),
        "SIZE": np.array([64, 64], I64),
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def _text(value: bytes) -> np.ndarray:
    return np.array([value], np.object_)


EXTREMES = [
    ("SIZE", np.array([INT64_MAX, 64], I64), "maximum"),
    ("SIZE", np.array([64, INT64_MAX], I64), "maximum"),
    ("SIZE", np.array([2**31, 2**31], I64), "maximum"),
    ("SIZE", np.array([INT64_MIN, 64], I64), "positive"),
    ("RESIZE", np.array([INT64_MAX, INT64_MAX], I64), "maximum"),
    ("RESIZE", np.array([INT64_MIN, 1], I64), "positive"),
    ("TIMESTEP_SHIFT", np.array([1e-38], F32), "0.001"),
    ("TIMESTEP_SHIFT", np.array([np.finfo(F32).tiny / 2], F32), "0.001"),  # subnormal
    ("TIMESTEP_SHIFT", np.array([3e38], F32), "1000"),
    ("CFG_SCALE", np.array([3e38], F32), "within"),
    ("CFG_SCALE", np.array([-3e38], F32), "within"),
    ("STEPS", np.array([INT64_MAX], I64), "1.."),
    ("STEPS", np.array([INT64_MIN], I64), "1.."),
    ("INDEX_OFFSET_COND", np.array([INT64_MAX], I64), "range"),
    ("INDEX_OFFSET_COND", np.array([INT64_MIN], I64), "range"),
]


@pytest.mark.parametrize("name,value,rule", EXTREMES, ids=[f"{n}-{i}" for i, (n, *_) in enumerate(EXTREMES)])
def test_extreme_values_are_refused_naming_the_input(name, value, rule):
    with pytest.raises(InputError) as info:
        parse_request(_inputs(**{name: value}), Limits(max_side=2048, max_pixels=2048 * 2048))
    message = str(info.value)
    assert message.startswith(f"{name}: ") and rule in message


def test_offsets_of_the_uncond_branch_are_bounded_too():
    extra = {"UNCOND_KV": torch.zeros(2, 2, 1, 1, 4, dtype=torch.bfloat16),
             "INDEX_OFFSET_UNCOND": np.array([INT64_MAX], I64)}
    with pytest.raises(InputError, match=r"^INDEX_OFFSET_UNCOND: .*range"):
        parse_request(_inputs(**extra), Limits())


def test_values_at_the_bounds_pass():
    ok = parse_request(_inputs(TIMESTEP_SHIFT=np.array([1e-3], F32), CFG_SCALE=np.array([-100.0], F32),
                               SIZE=np.array([2048, 2048], I64), RESIZE=np.array([1, 2048], I64),
                               INDEX_OFFSET_COND=np.array([1_000_000], I64)), Limits())
    assert ok.size == (2048, 2048) and ok.sampling_overrides["cfg_scale"] == -100.0
    # An interval only gates steps by comparison: extreme but ordered bounds are harmless.
    wide = parse_request(_inputs(CFG_INTERVAL=np.array([-3e38, 3e38], F32)), Limits())
    assert wide.sampling_overrides["cfg_interval"][0] < 0 < wide.sampling_overrides["cfg_interval"][1]


@pytest.mark.parametrize("name", ["OUTPUT_FORMAT", "CFG_NORM", "TASK"])
def test_a_huge_string_is_refused_without_being_echoed(name):
    with pytest.raises(InputError) as info:
        parse_request(_inputs(**{name: _text(b"x" * (4 << 20))}), Limits())
    message = str(info.value)
    assert message.startswith(f"{name}: ") and len(message) < 200 and str(4 << 20) in message


@pytest.mark.parametrize("name", ["OUTPUT_FORMAT", "CFG_NORM", "TASK"])
def test_non_utf8_and_unknown_words_are_refused_naming_the_input(name):
    with pytest.raises(InputError, match=f"^{name}: must be UTF-8"):
        parse_request(_inputs(**{name: _text(b"\xff\xfe" * 8)}), Limits())
    with pytest.raises(InputError, match=f"^{name}: unknown"):
        parse_request(_inputs(**{name: _text(b"y" * 60)}), Limits())


def test_an_unknown_input_with_a_huge_name_is_cut():
    with pytest.raises(InputError) as info:
        parse_request(_inputs(**{"Z" * 100_000: np.array([1], I64)}), Limits())
    assert len(str(info.value)) < 600


def test_shown_cuts_long_values_and_keeps_short_ones():
    assert shown("png") == "'png'" and shown(b"\xff") == "b'\\xff'"
    long = shown("a" * 10_000)
    assert long.startswith("'aaaa") and long.endswith("(10000 characters)") and len(long) < 80
    assert shown(b"b" * 5000).endswith("(5000 bytes)")
    assert len(shown(list(range(10_000)))) < 80


def test_check_finite_names_the_step():
    check_finite(torch.ones(4, 3), 1, 4)
    for bad in (float("nan"), float("inf"), -float("inf")):
        state = torch.ones(4, 3)
        state[2, 1] = bad
        with pytest.raises(NonFiniteState, match="step 3 of 4"):
            check_finite(state, 3, 4)
    assert issubclass(NonFiniteState, InputError)  # served as INVALID_ARG


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("limits") / "dense", "dense")
    return NeoPPPipeline.from_pretrained(ckpt, device="cpu", dtype=torch.float32)


def _request(pipe, fill: float | None, steps: int = 3) -> GenerationRequest:
    layers, kv_heads, head_dim = pipe.config.kv_dims
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(layers, 2, 6, kv_heads, head_dim, generator=g)
    if fill is not None:
        kv.fill_(fill)
    return GenerationRequest(cond_kv=kv.to(torch.bfloat16), index_offset_cond=6, height=32, width=32,
                             noise=torch.randn(1, 3, 32, 32, generator=g),
                             sampling_params=SamplingParams(infer_steps=steps, cfg_scale=1.0))


def test_a_finite_but_absurd_kv_fails_naming_the_step(pipe):
    req = _request(pipe, BF16_MAX)
    pipe.validate(req)  # every value is finite: the input checks let it through
    with pytest.raises(NonFiniteState, match=r"^cond_kv: .*at step \d of 3"):
        pipe.generate(req)


def test_a_sane_request_still_generates(pipe):
    pixels = pipe.generate(_request(pipe, None))
    assert pixels.shape == (32, 32, 3) and pixels.std() > 0


def test_a_request_s_step_plan_is_computed_once_and_follows_its_values():
    """Validation, the engine and the log line read the same plan object."""
    kv = torch.zeros(1, 2, 3, 1, 8)
    req = GenerationRequest(cond_kv=kv, index_offset_cond=3, height=64, width=64,
                            sampling_params=SamplingParams(infer_steps=4, cfg_interval=(0.2, 0.8)))
    assert step_plan(req) is step_plan(req)
    assert step_plan(req) == StepPlan.of(req.sampling_params)
    assert step_plan(req).times == tuple(shifted_timesteps(4, req.sampling_params.timestep_shift))
    assert step_plan(req).guided_steps == (False, False, True, True)  # t = 0, 0.1, 0.25, 0.5
    req.sampling_params = req.sampling_params.replace(enable_cfg=False)
    assert step_plan(req).guided_steps == (False,) * 4 and step_plan(req).branch_names(1) == ("cond",)
