"""LoRA per request: adapters applied unmerged, per row group of a step batch.

Exactness is checked three ways: one linear (bf16, float32, FP8 base weights) against a float64
product with the adapter merged into the weight; the whole tower against a float64 pipeline with
the adapter merged at load; and a step batch mixing the base model and two adapters, each request
equal to its solo bytes (the base one to today's bytes).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from neopp.model.adapters import RowGroup, build_adapter, row_adapters, tower_linears
from neopp.model.layers import Linear
from neopp.model.quant import FP8Linear, dequantize_fp8, quantize_fp8
from neopp.modes import ModeSpec
from neopp.sampling.pipeline import NeoPPPipeline
from testing.stream_requests import assert_pixels_match, make, run_step_batch, tiny_setup
from testing.tiny_lora import write_adapter

ATTN = ("q_proj_mot_gen", "k_proj_mot_gen", "v_proj_mot_gen", "o_proj_mot_gen")
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


def targets(linears, kinds=ATTN + ("gate_proj", "up_proj", "down_proj")):
    return sorted(k for k in linears if any(f".{kind}.weight" in k for kind in kinds))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_rows")
    ckpt, pipe, kvs = tiny_setup(root)
    linears = tower_linears(pipe.transformer)
    weights = {k: lin.weight for k, lin in linears.items()}
    folder = root / "adapters"
    write_adapter(folder, "style_a", weights, targets(linears), rank=4, seed=21)
    write_adapter(folder, "style_b", weights, targets(linears, ATTN), scheme="B_A", rank=8, seed=22,
                  prefix="diffusion_model.")
    write_adapter(folder, "style_peft", weights, targets(linears, ("v_proj_mot_gen", "down_proj")), scheme="peft",
                  rank=2, seed=23)
    pipe.use_adapter_dir(folder)
    return pipe, kvs, ckpt, folder


# ---- one linear against the merged float64 product ---------------------------------------

def one_linear(kind: str, dtype: torch.dtype) -> tuple[Linear, torch.Tensor]:
    """A base linear and the float64 weight it stands for."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(48, 64, generator=gen) / 8
    if kind == "fp8":
        q, scale = quantize_fp8(w)
        return FP8Linear(q, scale, kernel="dequant"), dequantize_fp8(q, scale).double()
    w = w.to(dtype)
    return Linear(w), w.double()


@pytest.mark.parametrize("kind,dtype", [("plain", torch.float32), ("plain", torch.bfloat16),
                                        ("fp8", torch.float32), ("fp8", torch.bfloat16)])
def test_one_linear_equals_the_float64_merged_product(tmp_path, kind, dtype):
    lin, w64 = one_linear(kind, dtype)
    write_adapter(tmp_path, "a", {"t.weight": w64}, ["t.weight"], rank=8, seed=3, gain=0.5)
    adapter = build_adapter("a", tmp_path / "a.safetensors", {"t.weight": lin}, torch.device("cpu"), dtype)
    f = adapter.factors[lin]
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    scale = 0.7
    delta64 = scale * f.factor * f.up.double() @ f.down.double()
    with row_adapters((RowGroup(100, 250, adapter, scale),)):
        got = lin(x).double()
    want = x.double() @ w64.T
    want[100:250] = x[100:250].double() @ (w64 + delta64).T
    # Each of the few roundings (the base product, x A^T, (x A^T) B^T, the scaled sum; the
    # factors' own cast to the run dtype is the same in the reference) is at most one unit
    # roundoff of the sum of absolute terms; 8 of them is a bound, not a fit.
    bound = 8 * UNIT_ROUNDOFF[dtype] * (x.double().abs() @ (w64.abs() + delta64.abs()).T)
    assert ((got - want).abs() <= bound + 1e-30).all()
    assert (got[:100] == lin(x).double()[:100]).all() and (got[250:] == lin(x).double()[250:]).all()
    # negative control: the delta is far above the bound, so a missing or misplaced one fails
    assert ((x[100:250].double() @ delta64.T).abs() > bound[100:250]).float().mean() > 0.5


# ---- the whole tower against the float64 pipeline with the adapter merged -----------------

def test_tower_unmerged_equals_the_float64_merged_model(setup):
    pipe, kvs, ckpt, folder = setup
    path = folder / "style_a.safetensors"
    req = make(kvs, 0, 64, 64, 2, 9, cfg_scale=3.0)
    merged64 = NeoPPPipeline.from_pretrained(ckpt, ModeSpec(lora_configs=({"path": str(path), "strength": 0.8},)),
                                             device="cpu", dtype=torch.float64)
    base64 = NeoPPPipeline.from_pretrained(ckpt, device="cpu", dtype=torch.float64)
    want = merged64.sample(req)
    req.lora, req.lora_scale = "style_a", 0.8
    got = pipe.sample(req)
    req.lora = None
    base_err = (pipe.sample(req) - base64.sample(req)).abs().max().item()
    err = (got - want).abs().max().item()
    # float32 against float64 over the same steps: the unmerged adapter may add rounding of its
    # own, of the order of the base model's float32 error, never a visible change.
    assert err <= 4 * base_err + 1e-6, (err, base_err)
    assert (want - base64.sample(req)).abs().max().item() > 100 * max(err, 1e-7)  # the adapter matters


# ---- step batches: mixed adapters equal solo bytes; absent equals today's bytes ---------

def run_batch(pipe, reqs, joins=None):
    return run_step_batch(pipe, reqs, joins)[0]


def lora_requests(kvs):
    reqs = [make(kvs, 0, 64, 96, 3, 1), make(kvs, 1, 96, 64, 2, 2, enable_cfg=False),
            make(kvs, 2, 64, 64, 3, 3, cfg_scale=3.0), make(kvs, 0, 64, 64, 2, 4)]
    for r, (name, scale) in zip(reqs, [(None, 1.0), ("style_a", 1.0), ("style_b", 0.6), ("style_a", -0.5)]):
        r.lora, r.lora_scale = name, scale
    return reqs


def test_mixed_adapters_in_one_batch_equal_their_solo_bytes(setup):
    pipe, kvs, ckpt, folder = setup
    reqs = lora_requests(kvs)
    solo = [run_batch(pipe, [r])[0] for r in reqs]
    batched = run_batch(pipe, reqs, {0: [0, 1], 1: [2, 3]})
    for i, (got, want) in enumerate(zip(batched, solo)):
        assert_pixels_match(got, want, f"request {i} ({reqs[i].lora})")
    today = NeoPPPipeline.from_pretrained(ckpt, device="cpu", dtype=torch.float32)  # no adapter code reached
    assert_pixels_match(batched[0], today.generate(reqs[0]), "LORA absent against today's pipeline")
    assert_pixels_match(solo[1], pipe.generate(reqs[1]), "one request alone: batcher and pipeline agree")
    # negative control: the adapters change the image, and so does the scale
    other = lora_requests(kvs)
    other[1].lora = None
    other[3].lora_scale = 0.5
    changed = run_batch(pipe, other)
    assert (changed[1] != batched[1]).mean() > 0.2 and (changed[3] != batched[3]).mean() > 0.2


def test_every_key_scheme_loads_to_the_same_factors(setup, tmp_path):
    pipe, kvs, ckpt, folder = setup
    weights = {k: lin.weight for k, lin in tower_linears(pipe.transformer).items()}
    keys = targets(weights, ("q_proj_mot_gen",))
    loaded = []
    for scheme, prefix in [("up_down", ""), ("up_down", "diffusion_model."), ("B_A", ""), ("peft", "")]:
        name = f"{scheme}{len(prefix)}"
        write_adapter(tmp_path, name, weights, keys, scheme=scheme, rank=4, seed=1, prefix=prefix)
        loaded.append(build_adapter(name, tmp_path / f"{name}.safetensors", tower_linears(pipe.transformer),
                                    pipe.device, pipe.dtype))
    for adapter in loaded[1:3]:
        for lin, f in adapter.factors.items():
            assert torch.equal(f.down, loaded[0].factors[lin].down) and f.factor == loaded[0].factors[lin].factor
    assert len(loaded[3].factors) == len(keys)


@pytest.mark.parametrize("mode, dtype", [(ModeSpec(dit_quantized=True, dit_quant_scheme="fp8-sgl"), torch.float32),
                                         (ModeSpec(), torch.bfloat16)])
def test_mixed_adapters_equal_solo_bytes_on_fp8_and_bf16_weights(setup, mode, dtype):
    pipe, kvs, ckpt, folder = setup
    other = NeoPPPipeline.from_pretrained(ckpt, mode, device="cpu", dtype=dtype)
    other.use_adapter_dir(folder)
    reqs = lora_requests(kvs)[:3]
    solo = [run_batch(other, [r])[0] for r in reqs]
    for i, got in enumerate(run_batch(other, reqs)):
        assert_pixels_match(got, solo[i], f"request {i} ({reqs[i].lora}, {dtype}, fp8={mode.dit_quantized})")
    assert (solo[1] != run_batch(other, [replace(reqs[1], lora=None)])[0]).mean() > 0.2  # the adapter matters


def test_the_adapter_hook_leaves_compiled_layers_whole():
    """Compiled layers run only steps without an adapter; the hook must not break their graph."""
    import torch._dynamo as dynamo

    lin = Linear(torch.randn(16, 16))
    assert dynamo.explain(lambda x: lin(x) * 2)(torch.randn(4, 16)).graph_break_count == 0


@pytest.mark.parametrize("method", ["fbcache", "taylorseer"])
def test_adapters_and_step_caches_share_a_batch_each_request_its_solo_bytes(setup, method):
    """Cached rows run (or skip) the tower under their own adapter: a request with both, beside
    requests with one or neither, gives its solo bytes; the adapter still changes what it draws."""
    pipe, kvs, _, _ = setup
    cached = {"cache": method, "cache_threshold": 0.3}
    reqs = [make(kvs, 0, 64, 64, 12, 1, **cached), make(kvs, 1, 64, 96, 12, 2, **cached),
            make(kvs, 2, 64, 64, 12, 3), make(kvs, 0, 96, 64, 12, 4, enable_cfg=False, **cached)]
    for r, (name, scale) in zip(reqs, [("style_a", 1.0), (None, 1.0), ("style_b", 0.6), ("style_a", -0.5)]):
        r.lora, r.lora_scale = name, scale
    solo = [run_batch(pipe, [r])[0] for r in reqs]
    for i, got in enumerate(run_batch(pipe, reqs, {0: [0, 1], 2: [2, 3]})):
        assert_pixels_match(got, solo[i], f"request {i} ({reqs[i].lora}, {reqs[i].sampling_params.cache})")
    assert (solo[0] != run_batch(pipe, [replace(reqs[0], lora=None)])[0]).mean() > 0.2  # the adapter matters
