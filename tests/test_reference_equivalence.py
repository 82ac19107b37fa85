"""The runner (NeoPPPipeline, float32 on CPU) against the independent float64 reference.

Tolerances, and why they are what they are
------------------------------------------
The runner computes in float32 (unit roundoff u = 6e-8), the reference in
float64 (exact for this purpose).  On the tiny checkpoints (2 layers, width
128, head 3072 wide, prefixes up to 300 tokens) the measured disagreement is
at float32 rounding level:
* one velocity: max |v_run - v_ref| <= 5.2e-7 * max |v_ref| over every case
  below (dense/pixel/MoE, t up to 0.995 where 1/(1-t) amplifies by 50x; the
  *relative* error does not grow because numerator and velocity scale alike);
* a whole generation (3-4 Euler steps, CFG scale 4): max |x_run - x_ref| <=
  1.4e-5 with max |x_ref| ~ 9, i.e. <= 1.6e-6 relative to the image's scale.
The asserted bounds are ~10x above those: VEL_RTOL = 5e-6 (relative to max
|v_ref|) and X_RTOL = 2e-5 (relative to max(1, max |x_ref|)).  That leaves room
for a different summation order (BLAS kernel, thread count) yet stays below
the effect of real mistakes, measured by mutating the reference (dense,
64x160, S=300, t=0.43): index offset + 1 -> 0.97 relative; noise embedder fed
t*1000 -> 0.22; vision RoPE rows/columns swapped -> 0.17; 3-D RoPE rows/columns
swapped -> 1.7e-2; rope_theta_hw replaced by rope_theta -> 1.7e-3;
tanh-approximate GELU -> 7e-5 (14x the bound).  Not detectable at this
precision: an RMSNorm eps of 1e-5 instead of 1e-6 (8e-7); test_checkpoint_fidelity
checks the checkpoint's eps with values large enough to see.  The offsets used
(<= 311) keep the float32 RoPE angle error (offset * u ~ 2e-5 rad) harmless.
"""

from __future__ import annotations

import json
import shutil
from functools import partial

import numpy as np
import pytest
import torch

from neopp.modes import ModeSpec, SamplingParams
from neopp.request import GenerationRequest
from neopp.sampling.guidance import COND, UNCOND, combine, guidance_plan, norm_clamp
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing.probes import branch_velocity
from testing.tiny_checkpoint import random_kv, tiny_config, write_tiny_checkpoint
from tests.reference import neopp_reference as ref

VEL_RTOL = 5e-6
X_RTOL = 2e-5
NL, NKV, HD = 2, 2, 32  # tiny checkpoint geometry (checked in the fixture)
kv = partial(random_kv, tiny_config("dense"), dtype=torch.float32)  # (tokens, seed) -> online-layout prefix

pytestmark = pytest.mark.usefixtures("one_thread")


class Model:
    def __init__(self, ckpt):
        self.ckpt = ckpt
        self.ref = ref.RefModel(ckpt)
        version = "moe" if self.ref.num_experts else "dense"
        self.pipe = NeoPPPipeline.from_pretrained(ckpt, ModeSpec(name="test", version=version),
                                                  device="cpu", dtype=torch.float32)
        assert (self.ref.NL, self.ref.NKV, self.ref.HD) == (NL, NKV, HD)
        assert self.pipe.config.kv_dims == (NL, NKV, HD)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny checkpoints: the lead's variants plus config.json edits exercising other settings."""
    root = tmp_path_factory.mktemp("ckpts")
    out = {v: write_tiny_checkpoint(root / v, v, seed=0) for v in ("dense", "pixel", "moe", "sharded")}

    def edited(base, name, **changes):
        folder = root / name
        shutil.copytree(out[base], folder)
        raw = json.loads((folder / "config.json").read_text())
        for key, value in changes.items():
            if key.startswith("llm."):
                raw["llm_config"][key[4:]] = value
            else:
                raw[key] = value
        (folder / "config.json").write_text(json.dumps(raw))
        return folder

    out["moe_softmax_all"] = edited("moe", "moe_softmax_all", **{"llm.norm_topk_prob": False})
    out["dynamic_sqrt"] = edited("dense", "dynamic_sqrt", noise_scale_mode="dynamic_sqrt", noise_scale=3.0)
    out["constant"] = edited("dense", "constant", noise_scale_mode="constant", noise_scale=0.7)
    out["capped"] = edited("dense", "capped", noise_scale=9.0, noise_scale_max_value=2.5)
    out["no_noise_emb"] = edited("pixel", "no_noise_emb", add_noise_scale_embedding=False)
    return {name: Model(path) for name, path in out.items()}


def request(H, W, cond, off_c, uncond=None, off_u=None, noise_seed=5, **sampling):
    return GenerationRequest(cond_kv=cond, index_offset_cond=off_c, height=H, width=W,
                             noise=NoiseStream(noise_seed).draw(H, W), sampling_params=SamplingParams(**sampling),
                             uncond_kv=uncond, index_offset_uncond=off_u)


def vel_err(v_run, v_ref):
    return ((v_run.double() - v_ref).abs().max() / v_ref.abs().max()).item()


def x_err(x_run, x_ref):
    return ((x_run.double() - x_ref).abs().max() / max(1.0, x_ref.abs().max().item())).item()


# --------------------------------------------------------------------------- one velocity

@pytest.mark.parametrize("variant", ["dense", "pixel", "moe", "moe_softmax_all", "sharded"])
@pytest.mark.parametrize("H,W,S,off", [(64, 160, 300, 311), (96, 32, 1, 3), (64, 64, 17, 0)])
@pytest.mark.parametrize("t", [0.0, 0.43, 0.995])
def test_branch_velocity_matches_reference(models, variant, H, W, S, off, t):
    m = models[variant]
    cond = kv(S, seed=S)
    uncond = kv(5, seed=99)
    req = request(H, W, cond, off, uncond, off + 13)
    x = NoiseStream(11).draw(H, W) * 1.7
    for branch, prefix, offset in (("cond", cond, off), ("uncond", uncond, off + 13)):
        v_run = branch_velocity(m.pipe, req, x, t, branch)
        assert v_run.shape == ((H // 32) * (W // 32), 32 * 32 * 3) and v_run.dtype == torch.float32
        v_ref = ref.reference_velocity(m.ref, prefix, offset, x, t, H, W)
        assert vel_err(v_run, v_ref) <= VEL_RTOL, (branch, vel_err(v_run, v_ref))


@pytest.mark.parametrize("variant", ["dynamic_sqrt", "constant", "capped", "no_noise_emb"])
def test_branch_velocity_other_noise_settings(models, variant):
    m = models[variant]
    cond = kv(9, seed=1)
    req = request(64, 96, cond, 20)
    x = NoiseStream(3).draw(64, 96)
    v_ref = ref.reference_velocity(m.ref, cond, 20, x, 0.3, 64, 96)
    assert vel_err(branch_velocity(m.pipe, req, x, 0.3, "cond"), v_ref) <= VEL_RTOL


def test_the_tests_can_fail(models):
    """Each input the reference uses must matter far beyond the tolerance."""
    m = models["dense"]
    cond = kv(300, seed=300)
    H, W = 64, 160
    req = request(H, W, cond, 311)
    x = NoiseStream(11).draw(H, W)
    v_run = branch_velocity(m.pipe, req, x, 0.43, "cond")
    wrong = {
        "offset + 1": ref.reference_velocity(m.ref, cond, 312, x, 0.43, H, W),
        "offset = S": ref.reference_velocity(m.ref, cond, 300, x, 0.43, H, W),
        "t": ref.reference_velocity(m.ref, cond, 311, x, 0.44, H, W),
        "prefix": ref.reference_velocity(m.ref, kv(300, seed=301), 311, x, 0.43, H, W),
        "prefix minus its last token": ref.reference_velocity(m.ref, cond[:, :, :-1], 311, x, 0.43, H, W),
    }
    for what, v_bad in wrong.items():
        assert vel_err(v_run, v_bad) > 100 * VEL_RTOL, what
    # and the runner itself sees the offset
    req2 = request(H, W, cond, 312)
    assert vel_err(branch_velocity(m.pipe, req2, x, 0.43, "cond"), wrong["offset + 1"]) <= VEL_RTOL


def test_guidance_combination_matches_reference():
    g = torch.Generator().manual_seed(0)
    v_c = torch.randn(6, 3072, generator=g, dtype=torch.float64)
    # tokens of very different size, so the per-token and global ratios differ
    v_u = torch.randn(6, 3072, generator=g, dtype=torch.float64) * torch.tensor([0.1, 0.5, 1, 2, 4, 8.0])[:, None]
    for norm in ("global", "channel", "none"):
        for scale in (1.5, 4.0):
            sampling = SamplingParams(cfg_scale=scale, cfg_norm=norm)
            got = combine({COND: v_c.float(), UNCOND: v_u.float()}, sampling).double()
            want = ref.combine(v_c, v_u, scale, norm)
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), (norm, scale)
    # the normalisations must differ from one another here (ratio < 1 per token and globally)
    g_, c_, n_ = (ref.combine(v_c, v_u, 4.0, n) for n in ("global", "channel", "none"))
    assert (g_ - n_).abs().max() > 1 and (c_ - g_).abs().max() > 1
    with pytest.raises(ValueError):
        norm_clamp(torch.lerp(v_u.float(), v_c.float(), 4.0), v_c.float(), "bogus")


# --------------------------------------------------------------------------- whole generations

GEN_CASES = [
    # variant, H, W, S_c, S_u, off_c, off_u, steps, shift, cfg_scale, interval, norm, enable_cfg
    ("dense", 64, 160, 300, 1, 311, 5, 4, 3.0, 4.0, (-1.0, 2.0), "global", True),
    ("dense", 64, 160, 300, 1, 311, 5, 4, 3.0, 4.0, (-1.0, 2.0), "channel", True),
    ("dense", 64, 160, 300, 1, 311, 5, 4, 3.0, 4.0, (-1.0, 2.0), "none", True),
    ("dense", 96, 32, 1, 300, 2, 290, 4, 3.0, 4.0, (0.2, 0.6), "global", True),   # steps 2, 3 guided
    ("dense", 96, 32, 1, 300, 2, 290, 4, 3.0, 2.5, (0.0, 0.15), "none", True),    # steps 0, 1 guided
    ("dense", 64, 160, 300, 1, 311, 5, 3, 1.0, 4.0, (-1.0, 2.0), "global", False),  # CFG off
    ("dense", 64, 64, 20, 20, 40, 9, 3, 3.0, 1.0, (-1.0, 2.0), "global", True),   # scale 1: no guidance
    ("pixel", 64, 160, 300, 1, 311, 5, 4, 3.0, 4.0, (-1.0, 2.0), "global", True),
    ("pixel", 96, 32, 7, 300, 30, 290, 4, 2.0, 3.0, (0.2, 0.6), "channel", True),
    ("pixel", 96, 32, 7, 3, 30, 1, 3, 3.0, 4.0, (-1.0, 2.0), "global", False),
    ("moe", 64, 160, 300, 1, 311, 5, 4, 3.0, 4.0, (-1.0, 2.0), "global", True),
    ("moe_softmax_all", 96, 32, 5, 7, 60, 6, 3, 3.0, 4.0, (-1.0, 2.0), "channel", True),
    ("dynamic_sqrt", 64, 96, 10, 4, 12, 3, 3, 3.0, 4.0, (-1.0, 2.0), "global", True),
    ("constant", 64, 96, 10, 4, 12, 3, 3, 3.0, 4.0, (-1.0, 2.0), "global", True),
    ("capped", 64, 96, 10, 4, 12, 3, 3, 3.0, 4.0, (-1.0, 2.0), "none", True),
    ("no_noise_emb", 64, 96, 10, 4, 12, 3, 3, 3.0, 4.0, (-1.0, 2.0), "global", True),
]


@pytest.mark.parametrize("case", GEN_CASES, ids=lambda c: "-".join(map(str, (c[0], f"{c[1]}x{c[2]}", c[11],
                                                                              "cfg" if c[12] else "nocfg",
                                                                              c[10]))))
def test_sample_matches_reference(models, case):
    variant, H, W, s_c, s_u, off_c, off_u, steps, shift, scale, interval, norm, enable = case
    m = models[variant]
    cond, uncond = kv(s_c, seed=s_c), kv(s_u, seed=1000 + s_u)
    req = request(H, W, cond, off_c, uncond, off_u, noise_seed=steps + H, infer_steps=steps,
                  timestep_shift=shift, cfg_scale=scale, cfg_interval=interval, cfg_norm=norm, enable_cfg=enable)
    ts = ref.shifted_timesteps(steps, shift)
    want_plan = [ref.uses_guidance(t, enable, scale, interval) for t in ts[:-1]]
    assert guidance_plan(req.sampling_params, ts) == want_plan  # takes t_0..t_N, one flag per step
    if enable and scale > 1 and interval != (-1.0, 2.0):
        assert any(want_plan) and not all(want_plan)  # the interval really covers only some steps

    x_run = m.pipe.sample(req)
    assert x_run.shape == (1, 3, H, W) and x_run.dtype == torch.float32
    x_ref = ref.reference_generate(m.ref, cond, uncond, off_c, off_u, H, W, req.noise, steps, shift,
                                   scale, interval, norm, enable)
    assert x_err(x_run, x_ref) <= X_RTOL, x_err(x_run, x_ref)

    if any(want_plan):
        # the uncond branch (and its own offset) really enters the result
        x_bad = ref.reference_generate(m.ref, cond, uncond, off_c, off_c, H, W, req.noise, steps, shift,
                                       scale, interval, norm, enable)
        assert x_err(x_run, x_bad) > 50 * X_RTOL

    pixels = m.pipe.generate(req)
    assert pixels.dtype == np.uint8 and pixels.shape == (H, W, 3)
    want_px = ref.reference_pixels(x_ref).astype(int)
    diff = np.abs(pixels.astype(int) - want_px)
    # float32 vs float64 may flip a rounding at a .5 boundary, nothing more
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01


def test_sample_sees_the_cond_offset(models):
    m = models["dense"]
    cond, uncond = kv(30, seed=1), kv(3, seed=2)
    req = request(64, 64, cond, 31, uncond, 4, infer_steps=3)
    x_run = m.pipe.sample(req)
    x_bad = ref.reference_generate(m.ref, cond, uncond, 30, 4, 64, 64, req.noise, 3, 3.0, 4.0, (-1.0, 2.0),
                                   "global", True)
    assert x_err(x_run, x_bad) > 50 * X_RTOL


def test_pipeline_guidance_plan_is_the_documented_api(models):
    """api.md: NeoPPPipeline.guidance_plan(req) -> list[bool], per step: does it use guidance."""
    req = request(64, 64, kv(3, seed=0), 3, kv(3, seed=1), 2, infer_steps=4, cfg_interval=(0.2, 0.6))
    assert models["dense"].pipe.guidance_plan(req) == [False, False, True, True]


def test_bf16_prefix_as_the_server_receives_it(models):
    """COND_KV arrives as BF16: the runner must use exactly those values (the reference widens them)."""
    m = models["pixel"]
    cond = kv(40, seed=4).to(torch.bfloat16)
    req = request(96, 64, cond, 50)
    x = NoiseStream(8).draw(96, 64)
    v_ref = ref.reference_velocity(m.ref, cond, 50, x, 0.6, 96, 64)
    assert vel_err(branch_velocity(m.pipe, req, x, 0.6, "cond"), v_ref) <= VEL_RTOL


def test_fp8_checkpoint_velocity(tmp_path):
    """FP8 checkpoint (float8_e4m3fn weights + per-output-channel `weight_scale`) in the fp8-sgl mode:
    on CPU float32 the runner must compute with the dequantised weights, which the reference also
    uses (weight * scale[:, None]).  The quantisation itself is real: the same velocity differs from
    the unquantised dense checkpoint's by ~2%, far above VEL_RTOL."""
    dense, fp8 = write_tiny_checkpoint(tmp_path / "dense", "dense"), write_tiny_checkpoint(tmp_path / "fp8", "fp8")
    mode = ModeSpec(name="fp8", version="dense", dit_quantized=True, dit_quant_scheme="fp8-sgl")
    pipe = NeoPPPipeline.from_pretrained(fp8, mode, device="cpu", dtype=torch.float32)
    cond = kv(30, seed=3)
    req = request(64, 160, cond, 31)
    x = NoiseStream(11).draw(64, 160)
    v_run = branch_velocity(pipe, req, x, 0.43, "cond")
    assert vel_err(v_run, ref.reference_velocity(ref.RefModel(fp8), cond, 31, x, 0.43, 64, 160)) <= VEL_RTOL
    assert vel_err(v_run, ref.reference_velocity(ref.RefModel(dense), cond, 31, x, 0.43, 64, 160)) > 1e-3
