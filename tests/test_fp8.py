"""FP8 (`fp8-sgl`) mode against the float32 result of the same checkpoint.

Bounds, and why they hold:
* One weight: e4m3 keeps 3 mantissa bits, so a value `u = w / s` in the normal range
  (|u| >= 2^-6) rounds with relative error <= 2^-4 (half an ulp); below it the subnormal
  spacing is 2^-9, so the absolute error is <= 2^-10. Hence
  `|w_q - w| <= max(2^-4 |w|, 2^-10 s)` per element with `s = absmax(row) / 448`.
* One linear: `|y_q - y|_i <= sum_j max(2^-4 |w_ij|, 2^-10 s_i) |x_j|` (plus float32 rounding).
  This is what each FP8 layer must meet, element by element. Random rounding makes the
  typical relative error ~ 2^-4 / sqrt(3) * E[1/mantissa] ~ 2.6% (measured 2.5-2.7%).
* One decoder layer: each sub-block runs two quantised linears in series (v->o,
  gate/up->down), so the error of the layer's update is at most ~ sqrt(2) * 2^-4 = 8.8% RMS
  of the update (measured 4.6-4.7% on the tiny checkpoint).
* Final image after 4 steps with CFG scale 4: the guided velocity scales the error of the
  cond-uncond difference by up to the scale; we allow 10% relative L2 on the final state and
  a mean pixel difference of 6/255 (measured 5.8% and ~3.8/255; the same run in bf16 gives
  1.7%). A missing or per-tensor scale, or a wrong layout, gives errors of order 100%.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from neopp.model.checkpoint import FP8_DTYPE, load_checkpoint
from neopp.model.quant import FP8Linear, dequantize_fp8, is_layer_linear, quantize_fp8, weight_bytes
from neopp.modes import ModeSpec, SamplingParams
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from neopp.sampling.sampler import to_pixels
from testing.probes import branch_velocity
from testing.tiny_checkpoint import random_kv, tiny_config, write_tiny_checkpoint
from tests.reference import neopp_reference as ref

SAMPLING = SamplingParams(infer_steps=4)
FP32 = ModeSpec(name="fp32", sampling_params=SAMPLING)
FP8 = ModeSpec(name="fp8", sampling_params=SAMPLING, dit_quantized=True, dit_quant_scheme="fp8-sgl")
H = W = 64


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {v: write_tiny_checkpoint(root / v, v) for v in ("dense", "fp8", "moe")}


@pytest.fixture(scope="module")
def pipes(ckpts):
    load = NeoPPPipeline.from_pretrained
    return {"fp32": load(ckpts["dense"], FP32, "cpu", torch.float32),
            "fp8": load(ckpts["dense"], FP8, "cpu", torch.float32),
            "fp8_pre": load(ckpts["fp8"], FP8, "cpu", torch.float32),
            "bf16": load(ckpts["dense"], FP32, "cpu", torch.bfloat16)}


def request(seed: int = 0) -> GenerationRequest:
    cfg = tiny_config("dense")
    return GenerationRequest(cond_kv=random_kv(cfg, 12, 1), index_offset_cond=13, height=H, width=W,
                             noise=NoiseStream(seed).draw(H, W), sampling_params=SAMPLING,
                             uncond_kv=random_kv(cfg, 5, 2), index_offset_uncond=6)


def weight_error_bound(w: torch.Tensor) -> torch.Tensor:
    s = w.abs().amax(dim=1, keepdim=True) / 448.0
    return torch.maximum(w.abs() * 2.0 ** -4, s * 2.0 ** -10)


def test_quantize_per_channel_scale_and_element_bound():
    gen = torch.Generator().manual_seed(3)
    # rows spanning 4 decades: a per-tensor scale would flush the small rows to zero
    w = torch.randn(32, 80, generator=gen) * torch.logspace(-4, 0, 32)[:, None]
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (32,)
    torch.testing.assert_close(scale, w.abs().amax(dim=1) / 448.0, rtol=1e-6, atol=0)
    err = (dequantize_fp8(q, scale) - w).abs()
    assert bool((err <= weight_error_bound(w) * (1 + 1e-5)).all())
    # the largest entry of each row lands exactly on +-448
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((32,), 448.0))


def test_fp8_linear_meets_the_elementwise_bound():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(48, 96, generator=gen) / 96 ** 0.5
    x = torch.randn(7, 96, generator=gen)
    q, scale = quantize_fp8(w)
    lin = FP8Linear(q, scale, kernel="dequant")
    y, y_ref = lin(x), F.linear(x, w)
    bound = x.abs() @ weight_error_bound(w).T + 1e-5 * (x.abs() @ w.abs().T)
    assert bool(((y - y_ref).abs() <= bound).all())
    rel = ((y - y_ref).norm() / y_ref.norm()).item()
    assert 1e-3 < rel < 2.0 ** -4  # really quantised, and within the rounding budget
    assert lin.nbytes() == 48 * 96 + 48 * 4


def test_layer_linears_are_fp8_and_memory_halves(pipes):
    fp8, bf16 = pipes["fp8"].transformer, pipes["bf16"].transformer
    for layer in fp8.layers:
        for lin in [layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj] + layer.mlp.linears():
            assert isinstance(lin, FP8Linear) and lin.weight.dtype == FP8_DTYPE
            # no full-precision copy kept anywhere on the layer object
            floats = [t for t in vars(lin).values() if isinstance(t, torch.Tensor) and t.numel() > t.shape[-1]]
            assert all(t.dtype == FP8_DTYPE for t in floats)
    for lin in (fp8.head.fc1, fp8.head.fc2, fp8.t_embed.fc1, fp8.t_embed.fc2):  # outside the layers: kept
        assert not isinstance(lin, FP8Linear) and lin.weight.dtype == torch.float32
    ratio = weight_bytes(fp8.linears()) / weight_bytes(bf16.linears())
    in_f = tiny_config("dense")["llm_config"]["hidden_size"]
    assert ratio <= 0.55
    assert ratio == pytest.approx(0.5 + 2 / in_f, abs=0.01)  # 1 byte + a 4-byte scale per row vs 2 bytes


def test_each_fp8_layer_linear_within_bound(pipes):
    gen = torch.Generator().manual_seed(5)
    for ref_lin, q_lin in zip(pipes["fp32"].transformer.linears(), pipes["fp8"].transformer.linears()):
        w = ref_lin.weight
        x = torch.randn(9, w.shape[1], generator=gen)
        err = (q_lin(x) - ref_lin(x)).abs()
        assert bool((err <= x.abs() @ weight_error_bound(w).T + 1e-5 * (x.abs() @ w.abs().T)).all())


def test_each_decoder_layer_output_within_bound(pipes):
    """Each layer gets the same input (the float32 run's) so its own error is measured."""
    req = request()
    t32, t8 = pipes["fp32"].transformer, pipes["fp8"].transformer
    grid = pipes["fp32"].grid(H, W)
    hid = t32.embed(req.noise, 0.3, 1.0, grid)
    for n, (l32, l8) in enumerate(zip(t32.layers, t8.layers)):
        outs = []
        for pipe, tower, layer in ((pipes["fp32"], t32, l32), (pipes["fp8"], t8, l8)):
            one = copy.copy(tower)
            one.layers = [layer]
            outs.append(one.run_layers(hid, pipe.branch(req.cond_kv[n:n + 1], req.index_offset_cond, grid)))
        rel = ((outs[1] - outs[0]).norm() / (outs[0] - hid).norm()).item()
        assert 1e-3 < rel < 2 ** 0.5 * 2.0 ** -4, f"layer {n}: relative error of the update {rel:.4f}"
        hid = outs[0]


def test_final_image_within_bound(pipes):
    req = request()
    x32, x8 = pipes["fp32"].sample(req), pipes["fp8"].sample(req)
    rel = ((x8 - x32).norm() / x32.norm()).item()
    assert 0.001 < rel < 0.10
    diff = np.abs(to_pixels(x8).astype(int) - to_pixels(x32).astype(int))
    assert diff.mean() < 6.0


def test_prequantised_and_load_time_quantised_agree(ckpts, pipes):
    _, stored = load_checkpoint(ckpts["fp8"])
    a, b = pipes["fp8"].transformer.linears(), pipes["fp8_pre"].transformer.linears()
    assert len(a) == len(b) > 0
    for la, lb in zip(a, b):
        assert torch.equal(la.weight.view(torch.uint8), lb.weight.view(torch.uint8))
        assert torch.equal(la.scale, lb.scale)
    # the pre-quantised weights are used as stored, not requantised
    key = "language_model.model.layers.1.mlp_mot_gen.down_proj.weight"
    down = pipes["fp8_pre"].transformer.layers[1].mlp.down
    assert torch.equal(down.weight.view(torch.uint8), stored[key].view(torch.uint8))
    assert torch.equal(down.scale, stored[key + "_scale"])
    req = request(1)
    torch.testing.assert_close(pipes["fp8"].sample(req), pipes["fp8_pre"].sample(req), rtol=1e-5, atol=1e-5)


def test_fp8_dequant_path_equals_reference_of_the_stored_weights(ckpts, pipes):
    """On CPU the FP8 mode computes exactly with `w_fp8 * scale` (the reference reads it so)."""
    req = request(2)
    x = req.noise * 1.3
    got = branch_velocity(pipes["fp8_pre"], req, x, 0.25).double()
    want = ref.reference_velocity(ckpts["fp8"], req.cond_kv, req.index_offset_cond, x, 0.25, H, W)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_moe_fp8_quantises_experts_not_router(ckpts):
    pipe = NeoPPPipeline.from_pretrained(ckpts["moe"], ModeSpec(name="m", version="moe", sampling_params=SAMPLING,
                                         dit_quantized=True, dit_quant_scheme="fp8-sgl"), "cpu", torch.float32)
    moe = pipe.transformer.layers[0].mlp
    assert not isinstance(moe.router, FP8Linear) and moe.router.weight.dtype == torch.float32
    assert all(isinstance(lin, FP8Linear) for e in moe.experts for lin in e.linears())
    assert is_layer_linear("language_model.model.layers.0.mlp_mot_gen.experts.3.up_proj.weight")
    assert not is_layer_linear("language_model.model.layers.0.mlp_mot_gen.gate.weight")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_scaled_mm_path_on_gpu():
    from neopp.model.quant import scaled_mm_supported

    dev = torch.device("cuda")
    if not scaled_mm_supported(dev):
        pytest.skip("row-wise scaled FP8 matmul needs compute capability 9.0+")
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(256, 512, generator=gen) / 512 ** 0.5
    x = torch.randn(37, 512, generator=gen)
    q, scale = quantize_fp8(w)
    fast = FP8Linear(q.to(dev), scale.to(dev), kernel="scaled_mm")
    slow = FP8Linear(q.to(dev), scale.to(dev), kernel="dequant")
    assert fast.use_scaled_mm and not slow.use_scaled_mm
    xb = x.to(dev, torch.bfloat16)
    y_fast, y_slow = fast(xb).float().cpu(), slow(xb).float().cpu()
    y_ref = F.linear(xb.float().cpu(), w)
    # activations are quantised too (per token, same 2^-4 rule) and the output is bf16 (2^-8)
    xa = xb.float().cpu().abs()
    bound = 2 * (xa @ weight_error_bound(w).T) + (2.0 ** -4 + 2.0 ** -7) * (xa @ w.abs().T)
    assert bool(((y_fast - y_ref).abs() <= bound).all())
    rel = ((y_fast - y_slow).norm() / y_slow.norm()).item()
    assert rel < 2.0 ** -4


def test_the_compiled_activation_quantisation_gives_the_eager_bytes():
    """One fused kernel (torch.compile; the CUDA default) or separate ones: the same FP8 bytes and
    scales, any row count (compiled once, for dynamic shapes), zero rows included."""
    from neopp.model.quant import activation_quantizer, compiled_quantize_rows, quantize_rows

    assert activation_quantizer(torch.device("cpu")) is quantize_rows  # nothing to fuse on the CPU
    assert activation_quantizer(torch.device("cpu"), "compiled") is compiled_quantize_rows()
    with pytest.raises(Exception, match="NEOPP_FP8_ACTIVATION_QUANT"):
        activation_quantizer(torch.device("cpu"), "fused")
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 77, 300):
        x = torch.randn(rows, 64, generator=gen) * torch.logspace(-3, 3, rows).unsqueeze(1)
        x[0] = 0.0
        want, got = quantize_rows(x), compiled_quantize_rows()(x)
        assert torch.equal(got[1], want[1])
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


def test_a_quantiser_that_cannot_compile_runs_eagerly():
    """Where torch.compile fails (no C compiler or Python headers), the FP8 products still run, with
    the eager quantiser's bytes, instead of every FP8 request failing."""
    from neopp.model.quant import CompiledOrEager, quantize_rows

    def no_compiler(x):
        raise RuntimeError("InductorError: no working C compiler found")

    quantiser = CompiledOrEager()
    quantiser.run = no_compiler
    x = torch.randn(16, 64)
    got, want = quantiser(x), quantize_rows(x)
    assert not quantiser.compiled
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
