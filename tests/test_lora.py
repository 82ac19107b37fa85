"""LoRA merge at load: every naming scheme, alpha/rank scaling, order, FP8 after merge, refusals.

The expected weights are computed here from the raw file keys written out by hand, in
float64, not through neopp.model.lora.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from neopp.errors import ConfigError
from neopp.model.checkpoint import FP8_DTYPE, load_checkpoint
from neopp.model.quant import FP8Linear
from neopp.modes import ModeSpec, SamplingParams, load_mode
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing.probes import branch_velocity
from testing.tiny_checkpoint import main as tiny_main
from testing.tiny_checkpoint import random_kv, tiny_config
from tests.reference import neopp_reference as ref

Q0 = "language_model.model.layers.0.self_attn.q_proj_mot_gen"
NAMES = {  # scheme -> (up suffix, down suffix)
    "up_down": (".lora_up.weight", ".lora_down.weight"),
    "B_A": (".lora_B.weight", ".lora_A.weight"),
    "peft": (".lora_B.default.weight", ".lora_A.default.weight"),
}
H = W = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    tiny_main(["--out", str(out), "--variant", "dense", "--variant", "fp8"])
    return out


def read(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


def expected_deltas(path, scheme: str, strength: float) -> dict[str, torch.Tensor]:
    """weight key -> strength * (alpha / rank) * up @ down, float64."""
    raw = read(path)
    up_sfx, down_sfx = NAMES[scheme]
    out = {}
    for key in raw:
        if key.endswith(up_sfx):
            base = key[: -len(up_sfx)]
            up, down = raw[key].double(), raw[base + down_sfx].double()
            rank = down.shape[0]
            factor = raw[base + ".alpha"].item() / rank if base + ".alpha" in raw else 1.0
            out[base + ".weight"] = strength * factor * (up @ down)
    return out


def mode(*loras, quantized: bool = False) -> ModeSpec:
    return ModeSpec(name="lora", sampling_params=SamplingParams(infer_steps=8, enable_cfg=False),
                      lora_configs=tuple({"path": str(p), "strength": s} for p, s in loras),
                      dit_quantized=quantized, dit_quant_scheme="fp8-sgl" if quantized else None)


def tower_weights(pipe: NeoPPPipeline) -> dict[str, torch.Tensor]:
    """Layer linears by checkpoint key (dense tower), as the pipeline holds them."""
    out = {}
    for i, layer in enumerate(pipe.transformer.layers):
        a, m = f"language_model.model.layers.{i}.self_attn.", f"language_model.model.layers.{i}.mlp_mot_gen."
        for name in ("q", "k", "v", "o"):
            out[f"{a}{name}_proj_mot_gen.weight"] = getattr(layer, f"{name}_proj")
        for name in ("gate", "up", "down"):
            out[f"{m}{name}_proj.weight"] = getattr(layer.mlp, name)
    return out


@pytest.mark.parametrize("scheme", ["up_down", "B_A", "peft"])
def test_merge_equals_independent_formula(tiny, scheme):
    path = tiny / "lora" / f"lora_{scheme}.safetensors"
    raw_keys = set(read(path))
    assert any(k.endswith(NAMES[scheme][0]) for k in raw_keys)
    assert (scheme == "peft") != any(k.endswith(".alpha") for k in raw_keys)  # with and without alpha
    _, base = load_checkpoint(tiny / "dense")
    deltas = expected_deltas(path, scheme, 0.7)
    assert deltas
    pipe = NeoPPPipeline.from_pretrained(tiny / "dense", mode((path, 0.7)), "cpu", torch.float32)
    for key, lin in tower_weights(pipe).items():
        want = base[key].double() + deltas.get(key, 0.0)
        torch.testing.assert_close(lin.weight.double(), want, rtol=0, atol=1e-6)
        if key not in deltas:
            assert torch.equal(lin.weight, base[key])


def test_several_loras_apply_in_order_and_alter_generation(tiny):
    files = [(tiny / "lora" / "lora_up_down.safetensors", 1.0), (tiny / "lora" / "neopp_8steps_lora.safetensors", -0.5)]
    _, base = load_checkpoint(tiny / "dense")
    want = {k: v.double() for k, v in base.items()}
    for (path, strength), scheme in zip(files, ["up_down", "up_down"]):
        for key, delta in expected_deltas(path, scheme, strength).items():
            want[key] = want[key] + delta
    pipe = NeoPPPipeline.from_pretrained(tiny / "dense", mode(*files), "cpu", torch.float32)
    for key, lin in tower_weights(pipe).items():
        torch.testing.assert_close(lin.weight.double(), want[key], rtol=0, atol=1e-6)


def test_merged_model_matches_reference_of_merged_checkpoint(tiny, tmp_path):
    """The forward really uses the merged weights: compare with the float64 reference."""
    path = tiny / "lora" / "neopp_8steps_lora.safetensors"
    merged_dir = tmp_path / "merged"
    merged_dir.mkdir()
    (merged_dir / "config.json").write_text((tiny / "dense" / "config.json").read_text())
    raw = read(tiny / "dense" / "model.safetensors")
    for key, delta in expected_deltas(path, "up_down", 1.0).items():
        raw[key] = (raw[key].double() + delta).float()
    save_file(raw, str(merged_dir / "model.safetensors"))
    pipe = NeoPPPipeline.from_pretrained(tiny / "dense", mode((path, 1.0)), "cpu", torch.float32)
    cfg = tiny_config("dense")
    req = GenerationRequest(cond_kv=random_kv(cfg, 10, 3), index_offset_cond=11, height=H, width=W,
                            noise=NoiseStream(4).draw(H, W))
    got = branch_velocity(pipe, req, req.noise, 0.4).double()
    want = ref.reference_velocity(merged_dir, req.cond_kv, 11, req.noise, 0.4, H, W)
    plain = ref.reference_velocity(tiny / "dense", req.cond_kv, 11, req.noise, 0.4, H, W)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert ((plain - want).norm() / want.norm()).item() > 0.05  # the LoRA matters


@pytest.mark.parametrize("ckpt", ["dense", "fp8"])
def test_fp8_after_merge(tiny, ckpt):
    """Merge first (on the dequantised weight for an FP8 checkpoint), then quantise per row."""
    path = tiny / "lora" / "lora_B_A.safetensors"
    _, base = load_checkpoint(tiny / ckpt)
    deltas = expected_deltas(path, "B_A", 1.3)
    pipe = NeoPPPipeline.from_pretrained(tiny / ckpt, mode((path, 1.3), quantized=True), "cpu", torch.float32)
    for key, lin in tower_weights(pipe).items():
        assert isinstance(lin, FP8Linear)
        w = base[key].double()
        if key + "_scale" in base:
            w = w * base[key + "_scale"].double()[:, None]
        w = (w + deltas.get(key, 0.0)).float()
        scale = w.abs().amax(dim=1) / 448.0
        torch.testing.assert_close(lin.scale, scale, rtol=1e-6, atol=0)
        q = (w / scale[:, None]).to(FP8_DTYPE)
        mismatch = (lin.weight.float() != q.float()).float().mean().item()
        assert mismatch < 0.002, f"{key}: {mismatch:.4f} of the FP8 values differ"  # ties at rounding only


def test_8steps_mode_file_and_tiny_command(tiny):
    mode_8 = load_mode("configs/neopp/neopp_dense_8steps.json", lora_dir=tiny / "lora")
    assert mode_8.sampling_params.infer_steps == 8 and not mode_8.sampling_params.enable_cfg
    assert mode_8.lora_configs[0]["path"] == str((tiny / "lora" / "neopp_8steps_lora.safetensors").resolve())
    for name in ("neopp_8steps_lora", "lora_up_down", "lora_B_A", "lora_peft"):
        assert (tiny / "lora" / f"{name}.safetensors").is_file()


def test_8steps_runs_no_uncond_pass_even_with_uncond(tiny):
    path = tiny / "lora" / "neopp_8steps_lora.safetensors"
    pipe = NeoPPPipeline.from_pretrained(tiny / "dense", mode((path, 1.0)), "cpu", torch.float32)
    cfg = tiny_config("dense")
    req = GenerationRequest(cond_kv=random_kv(cfg, 10, 3), index_offset_cond=11, height=H, width=W,
                            noise=NoiseStream(4).draw(H, W), sampling_params=pipe.mode.sampling_params,
                            uncond_kv=random_kv(cfg, 6, 9), index_offset_uncond=7)
    pipe.validate(req)
    assert pipe.guidance_plan(req) == [False] * 8
    assert pipe.prepare(req).uncond is None
    steps: list[int] = []
    with_uncond = pipe.sample(req, on_step=lambda k, s: steps.append(k))
    assert steps == list(range(8))
    req.uncond_kv, req.index_offset_uncond = None, None
    assert torch.equal(with_uncond, pipe.sample(req))


# ---- refusals ---------------------------------------------------------------------------

def write_lora(path, tensors):
    save_file({k: v.clone() for k, v in tensors.items()}, str(path))
    return path


@pytest.mark.parametrize("case", ["no_weight", "rows", "cols", "rank", "unknown_suffix", "no_down", "not_linear",
                                  "mixed"])
def test_bad_lora_refused_naming_the_key(tiny, tmp_path, case):
    good_up, good_down = torch.zeros(128, 2), torch.zeros(2, 128)
    files = {
        "no_weight": ({"language_model.model.layers.7.self_attn.q_proj_mot_gen.lora_up.weight": good_up,
                       "language_model.model.layers.7.self_attn.q_proj_mot_gen.lora_down.weight": good_down},
                      "language_model.model.layers.7.self_attn.q_proj_mot_gen.lora_up.weight"),
        "rows": ({Q0 + ".lora_B.weight": torch.zeros(64, 2), Q0 + ".lora_A.weight": good_down},
                 Q0 + ".lora_B.weight"),
        "cols": ({Q0 + ".lora_up.weight": good_up, Q0 + ".lora_down.weight": torch.zeros(2, 96)},
                 Q0 + ".lora_down.weight"),
        "rank": ({Q0 + ".lora_up.weight": good_up, Q0 + ".lora_down.weight": torch.zeros(3, 128)},
                 Q0 + ".lora_up.weight"),
        "unknown_suffix": ({Q0 + ".lora_up.weight": good_up, Q0 + ".lora_down.weight": good_down,
                            Q0 + ".lora_mid.weight": good_down}, Q0 + ".lora_mid.weight"),
        "no_down": ({Q0 + ".lora_B.default.weight": good_up}, Q0 + ".lora_B.default.weight"),
        "not_linear": ({"language_model.model.layers.0.input_layernorm_mot_gen.lora_up.weight": good_up,
                        "language_model.model.layers.0.input_layernorm_mot_gen.lora_down.weight": good_down},
                       "language_model.model.layers.0.input_layernorm_mot_gen.lora_up.weight"),
        "mixed": ({Q0 + ".lora_up.weight": good_up, Q0 + ".lora_A.weight": good_down}, Q0),
    }
    tensors, key = files[case]
    path = write_lora(tmp_path / f"{case}.safetensors", tensors)
    with pytest.raises(ConfigError, match=re.escape(key)):
        NeoPPPipeline.from_pretrained(tiny / "dense", mode((path, 1.0)), "cpu", torch.float32)


def test_understanding_tower_key_is_not_a_target(tiny, tmp_path):
    """`q_proj` (no _mot_gen) exists in the file but is not loaded: refusing beats a silent skip."""
    key = "language_model.model.layers.0.self_attn.q_proj.lora_up.weight"
    path = write_lora(tmp_path / "und.safetensors", {key: torch.zeros(128, 2),
                                                     key.replace("lora_up", "lora_down"): torch.zeros(2, 128)})
    with pytest.raises(ConfigError, match=re.escape(key)):
        NeoPPPipeline.from_pretrained(tiny / "dense", mode((path, 1.0)), "cpu", torch.float32)


def test_missing_or_unreadable_file_refused(tiny, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        NeoPPPipeline.from_pretrained(tiny / "dense", mode((tmp_path / "nope.safetensors", 1.0)), "cpu")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ConfigError, match="bad.safetensors"):
        NeoPPPipeline.from_pretrained(tiny / "dense", mode((bad, 1.0)), "cpu")
