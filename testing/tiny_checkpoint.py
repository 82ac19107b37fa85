"""Deterministic tiny checkpoints in the real SenseNova-U1 key layout, and matching KV files.

Used by the tests, and by `make serve NEOPP_CHECKPOINT=build/tiny/dense` after `make tiny`. Each variant is a
complete checkpoint folder (config.json + safetensors); weights are random but scaled so that
activations stay O(1) and images are not flat.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from neopp.model.checkpoint import FM, LM, VISION, layer_prefix
from neopp.model.kv_cache import ONLINE, REPLAY, save_kv_file
from testing.tiny_lora import write_tiny_loras  # LoRA files fit the dense/fp8/sharded variants of a seed

VARIANTS = ("dense", "pixel", "moe", "fp8", "sharded")
TINY_LLM = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "rope_theta": 1_000_000.0, "rope_theta_hw": 10_000.0}
TINY_VISION = {"hidden_size": 64, "rope_theta_vision": 10_000.0, "max_position_embeddings_vision": 1024}
MLP_WIDTH, HEAD_WIDTH, PIXEL_CONV1 = 256, 256, 64
MOE_EXPERTS, MOE_TOP_K = 4, 2
# The tiny weights are random, so no size is drawn better than another: every size the default
# limits allow counts as trained; a test narrows it with overrides={"image_size_range": [...]}.
TRAINED_SIDES = [32, 2048]


def tiny_config(variant: str = "dense", overrides: dict | None = None) -> dict:
    """config.json of a variant; `overrides` sets top-level keys, and keys inside `llm_config` /
    `vision_config` when given as dicts under those names (a value of None removes the key)."""
    llm = dict(TINY_LLM)
    if variant == "moe":
        llm.update(gen_num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K, norm_topk_prob=True)
    cfg = {"model_type": "neo_chat", "llm_config": llm, "vision_config": dict(TINY_VISION),
           "patch_size": 16, "use_pixel_head": variant == "pixel", "image_size_range": list(TRAINED_SIDES)}
    for key, value in (overrides or {}).items():
        if key in ("llm_config", "vision_config"):
            _edit(cfg[key], value)
        else:
            _edit(cfg, {key: value})
    return cfg


def _edit(section: dict, changes: dict) -> None:
    for key, value in changes.items():
        if value is None:
            section.pop(key, None)
        else:
            section[key] = value


class _Init:
    """Seeded weights: linears ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1^2)."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def linear(self, out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=self.gen) * (gain / in_f ** 0.5)

    def conv(self, out_c: int, in_c: int, k: int) -> torch.Tensor:
        return torch.randn(out_c, in_c, k, k, generator=self.gen) / (in_c * k * k) ** 0.5

    def vec(self, n: int, base: float = 0.0, std: float = 0.1) -> torch.Tensor:
        return base + std * torch.randn(n, generator=self.gen)


def tiny_tensors(cfg: dict, seed: int = 0, mlp_width: int = MLP_WIDTH,
                 head_width: int = HEAD_WIDTH) -> dict[str, torch.Tensor]:
    """Random weights for `cfg`; the widths are free (the benchmarks build mid-size towers)."""
    llm, vis = cfg["llm_config"], cfg["vision_config"]
    D, DV, HD = llm["hidden_size"], vis["hidden_size"], llm["head_dim"]
    NH, NKV, T = llm["num_attention_heads"], llm["num_key_value_heads"], 32
    g = _Init(seed)
    w: dict[str, torch.Tensor] = {
        VISION + "patch_embedding.weight": g.conv(DV, 3, 16), VISION + "patch_embedding.bias": g.vec(DV),
        VISION + "dense_embedding.weight": g.conv(D, DV, 2), VISION + "dense_embedding.bias": g.vec(D),
        LM + "norm_mot_gen.weight": g.vec(D, 1.0),
    }
    for emb in ("timestep_embedder", "noise_scale_embedder"):
        p = f"{FM}{emb}.mlp."
        w.update({p + "0.weight": g.linear(D, 256, 2.0), p + "0.bias": g.vec(D),
                  p + "2.weight": g.linear(D, D), p + "2.bias": g.vec(D)})
    if cfg.get("use_pixel_head"):
        h = FM + "fm_head."
        w.update({h + "conv1.weight": g.conv(PIXEL_CONV1, D // 4, 3), h + "conv1.bias": g.vec(PIXEL_CONV1),
                  h + "conv2.weight": g.conv(192, PIXEL_CONV1 // 4, 3), h + "conv2.bias": g.vec(192)})
    else:
        w.update({FM + "fm_head.0.weight": g.linear(head_width, D), FM + "fm_head.0.bias": g.vec(head_width),
                  FM + "fm_head.2.weight": g.linear(T * T * 3, head_width), FM + "fm_head.2.bias": g.vec(T * T * 3)})
    for i in range(llm["num_hidden_layers"]):
        p, a, m = layer_prefix(i), layer_prefix(i) + "self_attn.", layer_prefix(i) + "mlp_mot_gen."
        w.update({p + "input_layernorm_mot_gen.weight": g.vec(D, 1.0),
                  p + "post_attention_layernorm_mot_gen.weight": g.vec(D, 1.0),
                  a + "q_proj_mot_gen.weight": g.linear(NH * HD, D), a + "k_proj_mot_gen.weight": g.linear(NKV * HD, D),
                  a + "v_proj_mot_gen.weight": g.linear(NKV * HD, D),
                  a + "o_proj_mot_gen.weight": g.linear(D, NH * HD)})
        for norm in ("q_norm_mot_gen", "k_norm_mot_gen", "q_norm_hw_mot_gen", "k_norm_hw_mot_gen"):
            w[a + norm + ".weight"] = g.vec(HD // 2, 1.0)
        n_experts = llm.get("gen_num_experts") or llm.get("num_experts") or 0  # the gen key, else the shared one
        experts = [f"{m}experts.{j}." for j in range(n_experts)] or [m]
        if n_experts:
            w[m + "gate.weight"] = g.linear(n_experts, D, 4.0)
        for e in experts:
            w.update({e + "gate_proj.weight": g.linear(mlp_width, D), e + "up_proj.weight": g.linear(mlp_width, D),
                      e + "down_proj.weight": g.linear(D, mlp_width)})
        # Keys of the understanding tower: present in real checkpoints, never loaded.
        w[a + "q_proj.weight"] = g.linear(NH * HD, D)
    w["vision_model.embeddings.patch_embedding.weight"] = g.conv(8, 3, 16)
    return w


def write_tiny_checkpoint(out_dir: str | Path, variant: str = "dense", seed: int = 0,
                          overrides: dict | None = None) -> Path:
    """A checkpoint folder; `fp8` stores pre-quantised decoder linears, `sharded` uses an index.

    `overrides` edits config.json as :func:`tiny_config` does (weights follow the edited config)."""
    from neopp.model.quant import quantize_checkpoint_tensors

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(variant, overrides)
    tensors = tiny_tensors(cfg, seed)
    if variant == "fp8":
        tensors = quantize_checkpoint_tensors(tensors)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if variant == "sharded":
        keys = sorted(tensors)
        halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
        for name, part in halves.items():
            save_file({k: tensors[k].contiguous() for k in part}, str(out / name))
        index = {"metadata": {}, "weight_map": {k: n for n, part in halves.items() for k in part}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def random_kv(cfg: dict, tokens: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An online-layout prefix [NL, 2, S, NKV, HD] with O(1) values."""
    llm = cfg["llm_config"]
    g = torch.Generator().manual_seed(seed)
    shape = (llm["num_hidden_layers"], 2, tokens, llm["num_key_value_heads"], llm["head_dim"])
    return torch.randn(shape, generator=g).to(dtype)


def write_sample_kv(out_dir: str | Path, variant: str = "dense", cond_tokens: int = 24,
                    uncond_tokens: int = 7, seed: int = 100) -> dict[str, Path]:
    """cond/uncond prefixes in every file form the tools accept."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(variant)
    paths = {}
    for i, (name, tokens) in enumerate((("cond", cond_tokens), ("uncond", uncond_tokens))):
        kv = random_kv(cfg, tokens, seed + i)
        paths[f"{name}_pt"] = save_kv_file(kv, out / f"{name}_kv.pt", REPLAY)
        paths[f"{name}_replay"] = save_kv_file(kv, out / f"{name}_kv.replay.safetensors", REPLAY)
        paths[f"{name}_online"] = save_kv_file(kv, out / f"{name}_kv.online.safetensors", ONLINE)
    return paths


def write_mismatched_loras(out_dir: str | Path) -> Path:
    """The tiny LoRA files made for hidden size 256: they fit no tiny checkpoint (hidden 128)."""
    config = tiny_config("dense")
    config["llm_config"].update(hidden_size=256, num_attention_heads=8)
    write_tiny_loras(out_dir, tiny_tensors(config, 0))
    return Path(out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="folder to write (a checkpoint per variant below it)")
    parser.add_argument("--variant", action="append", choices=VARIANTS,
                        help="variants to write (default: all); each goes to <out>/<variant>")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-tokens", type=int, default=24, help="cond prefix length of the sample KV")
    args = parser.parse_args(argv)
    for variant in args.variant or VARIANTS:
        ckpt = write_tiny_checkpoint(Path(args.out) / variant, variant, args.seed)
        write_sample_kv(ckpt / "sample_kv", variant, cond_tokens=args.kv_tokens)
        print(f"wrote {ckpt}")
    for path in write_tiny_loras(Path(args.out) / "lora", tiny_tensors(tiny_config("dense"), args.seed)).values():
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
