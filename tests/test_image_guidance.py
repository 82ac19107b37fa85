"""Image-editing (three-branch) guidance, in-process, against the float64 reference.

The reference (`neopp_reference.reference_generate_image_edit`) writes the rule plainly: which
steps are guided (open cfg_interval, or all when low is 0), which branches each one evaluates,
the formula of each case and when the norm clamp applies. Tolerances are those of
tests/test_reference_equivalence.py (X_RTOL = 2e-5 relative to the image scale: float32 against
float64 over 4 Euler steps, measured there at <= 1.6e-6); a third branch adds one more float32
velocity of the same size, so the same bound holds. The controls below show each branch and
the open interval moving the result by far more than that.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch

from neopp.errors import InputError
from neopp.limits import Limits
from neopp.modes import ModeSpec, SamplingParams
from neopp.request import GenerationRequest
from neopp.sampling.guidance import combine
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing.tiny_checkpoint import random_kv, tiny_config, write_tiny_checkpoint
from tests.reference import neopp_reference as ref

X_RTOL = 2e-5
H, W, STEPS, SHIFT = 64, 96, 4, 3.0  # times 0, 0.1, 0.25, 0.5 (then 1)
kv = partial(random_kv, tiny_config("dense"), dtype=torch.float32)
PREFIXES = {"cond": (kv(30, seed=1), 41), "uncond": (kv(4, seed=2), 5), "image": (kv(22, seed=3), 27)}

# id -> (cfg_scale, image_guidance_scale, cfg_interval, cfg_norm, enable_cfg, branches of a guided step)
CASES = {
    "both-one": (1.0, 1.0, (-1.0, 2.0), "global", True, ()),
    "image-scale-one": (4.0, 1.0, (-1.0, 2.0), "global", True, ("image",)),
    "equal-scales": (2.5, 2.5, (-1.0, 2.0), "channel", True, ("uncond",)),
    "three-branches": (4.0, 2.0, (-1.0, 2.0), "global", True, ("uncond", "image")),
    "three-no-clamp": (0.8, 0.5, (-1.0, 2.0), "global", True, ("uncond", "image")),
    "open-interval": (4.0, 2.0, (0.09, 0.5), "channel", True, ("uncond", "image")),   # t = 0.5 is outside
    "low-zero": (3.0, 1.5, (0.0, 0.2), "none", True, ("uncond", "image")),          # low == 0: every step
    "cfg-disabled": (4.0, 1.0, (-1.0, 2.0), "global", False, ("image",)),
}
EXPECTED_PLAN = {"both-one": [False] * 4, "open-interval": [False, True, True, False],
                 "low-zero": [True] * 4, "cfg-disabled": [False] * 4}

pytestmark = pytest.mark.usefixtures("one_thread")


def image_request(case: str, prefixes=PREFIXES, noise_seed: int = 9) -> GenerationRequest:
    s, s_img, interval, norm, enable, _ = CASES[case]
    sampling = SamplingParams(infer_steps=STEPS, timestep_shift=SHIFT, cfg_scale=s, image_guidance_scale=s_img,
                              cfg_interval=interval, cfg_norm=norm, enable_cfg=enable)
    (c, oc), (u, ou), (i, oi) = prefixes["cond"], prefixes["uncond"], prefixes["image"]
    return GenerationRequest(cond_kv=c, index_offset_cond=oc, uncond_kv=u, index_offset_uncond=ou,
                             image_kv=i, index_offset_image=oi, height=H, width=W,
                             noise=NoiseStream(noise_seed).draw(H, W), sampling_params=sampling)


def reference_image(case: str, prefixes=PREFIXES, noise_seed: int = 9):
    s, s_img, interval, norm, enable, _ = CASES[case]
    return ref.reference_generate_image_edit(ckpt_ref(), prefixes, H, W, NoiseStream(noise_seed).draw(H, W),
                                             STEPS, SHIFT, s, s_img, interval, norm, enable)


def x_err(x_run, x_ref) -> float:
    return ((x_run.double() - x_ref).abs().max() / max(1.0, x_ref.abs().max().item())).item()


_STATE: dict = {}


def ckpt_ref():
    return _STATE["ref"]


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("i2i") / "dense", "dense", seed=0)
    _STATE["ref"] = ref.RefModel(path)
    _STATE["path"] = path
    return NeoPPPipeline.from_pretrained(path, ModeSpec(name="test"), device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("case", list(CASES))
def test_image_editing_matches_reference(pipe, case):
    req = image_request(case)
    x_ref, ran = reference_image(case)
    guided = [len(names) > 1 for names in ran]
    assert pipe.guidance_plan(req) == guided
    if case in EXPECTED_PLAN:
        assert guided == EXPECTED_PLAN[case]  # the reference itself reads the rule as the brief states it
    if any(guided):
        assert all(names == ["cond", *CASES[case][5]] for names, g in zip(ran, guided) if g)
    assert sorted(pipe.prepare(req).branches) == sorted({n for names in ran for n in names})
    for batching in ("on", "off"):
        pipe.cfg_batching = batching
        try:
            x_run = pipe.sample(image_request(case))
        finally:
            pipe.cfg_batching = "auto"
        assert x_err(x_run, x_ref) <= X_RTOL, (batching, x_err(x_run, x_ref))


@pytest.mark.parametrize("case,branch", [("image-scale-one", "image"), ("equal-scales", "uncond"),
                                         ("three-branches", "image"), ("three-branches", "uncond")])
def test_each_branch_enters_the_result(pipe, case, branch):
    """Control: replacing one branch's prefix moves the image far beyond the tolerance."""
    swapped = dict(PREFIXES, **{branch: (kv(9, seed=77), 11)})
    x_run = pipe.sample(image_request(case))
    x_bad, _ = reference_image(case, swapped)
    assert x_err(x_run, x_bad) > 50 * X_RTOL


def test_open_interval_differs_from_closed(pipe):
    """Control: guiding the step at t = 0.5 too (a closed interval) changes the image."""
    x_run = pipe.sample(image_request("open-interval"))
    x_closed, _ = ref.reference_generate_image_edit(ckpt_ref(), PREFIXES, H, W, NoiseStream(9).draw(H, W),
                                                   STEPS, SHIFT, 4.0, 2.0, (0.09, 0.51), "channel", True)
    assert x_err(x_run, x_closed) > 50 * X_RTOL


def test_combine_each_case_matches_reference():
    g = torch.Generator().manual_seed(0)
    v = {n: torch.randn(6, 300, generator=g, dtype=torch.float64) * (1 + i) for i, n in
         enumerate(("cond", "uncond", "image"))}
    for s, s_img in ((4.0, 1.0), (2.5, 2.5), (4.0, 2.0), (0.8, 0.5), (1.0, 3.0)):
        for norm in ("global", "channel", "none"):
            sampling = SamplingParams(cfg_scale=s, image_guidance_scale=s_img, cfg_norm=norm)
            got = combine({n: t.float() for n, t in v.items()}, sampling, image=True).double()
            want = ref.image_guided_velocity(v, s, s_img, norm)
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), (s, s_img, norm)


@pytest.mark.parametrize("norm", ["global", "channel"])
@pytest.mark.parametrize("image", [False, True])
def test_the_clamp_never_scales_the_guided_velocity_up(norm, image):
    """With v_u = 1.5 v_c and s = 2, the guided velocity is 0.5 v_c: its norm is below the cond
    one's, so the ratio is 2 and the clamp keeps it at 1: the result stays 0.5 v_c. A clamp that
    let the ratio above 1 would give v_c (or more) instead."""
    v_c = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    branches = {"cond": v_c, "uncond": 1.5 * v_c, "image": 1.5 * v_c}
    sampling = SamplingParams(cfg_scale=2.0, image_guidance_scale=2.0 if image else 1.0, cfg_norm=norm)
    got = combine({n: t.clone() for n, t in branches.items()}, sampling, image=image)
    assert torch.allclose(got, 0.5 * v_c, rtol=1e-6, atol=1e-6)
    big = combine({"cond": v_c, "uncond": -v_c, "image": -v_c}, sampling, image=image)  # 3 v_c: scaled down
    assert torch.allclose(big, v_c, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- the request rules

def _validate(pipe, case: str, **changes) -> None:
    req = image_request(case)
    for key, value in changes.items():
        setattr(req, key, value)
    pipe.validate(req)


def test_image_guidance_without_image_branch_is_refused(pipe):
    with pytest.raises(InputError, match=r"^image_guidance_scale: 2 refused without the image branch"):
        _validate(pipe, "three-branches", image_kv=None, index_offset_image=None)


@pytest.mark.parametrize("case,missing", [("three-branches", "uncond"), ("equal-scales", "uncond")])
def test_missing_uncond_is_named_with_the_reason(pipe, case, missing):
    with pytest.raises(InputError, match=r"^uncond_kv: required because image_guidance_scale .* cfg_scale"):
        _validate(pipe, case, uncond_kv=None, index_offset_uncond=None)


def test_image_scale_one_needs_no_uncond(pipe):
    _validate(pipe, "image-scale-one", uncond_kv=None, index_offset_uncond=None)


@pytest.mark.parametrize("changes,message", [
    ({"index_offset_image": None}, "index_offset_image: required when image_kv is given"),
    ({"image_kv": None}, "index_offset_image: given without image_kv"),
    ({"index_offset_image": -3}, "index_offset_image: -3 is out of range"),
    ({"image_kv": kv(3, seed=1)[:, :, :, :1]}, "image_kv"),
    ({"image_kv": torch.full((2, 2, 3, 2, 32), float("nan"))}, "image_kv"),
])
def test_image_kv_is_checked_like_uncond(pipe, changes, message):
    with pytest.raises(InputError, match=f"^{message}"):
        _validate(pipe, "three-branches", **changes)


def test_disabled_guidance_refuses_an_image_scale():
    with pytest.raises(InputError, match=r"^image_guidance_scale: 2 refused; guidance is disabled"):
        SamplingParams(enable_cfg=False, image_guidance_scale=2.0)
    with pytest.raises(InputError, match=r"^image_guidance_scale: must be within -100..100"):
        SamplingParams(image_guidance_scale=101.0)


def test_image_kv_length_is_bounded(pipe):
    rules = pipe.rules
    pipe.rules = replace(rules, limits=Limits(max_prefix_tokens=21))  # the image prefix has 22 tokens
    try:
        with pytest.raises(InputError, match=r"^image_kv: .*limit"):
            _validate(pipe, "three-branches", cond_kv=kv(20, seed=1), index_offset_cond=20)
    finally:
        pipe.rules = rules
