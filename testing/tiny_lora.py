"""Tiny LoRA files for the tests and benchmarks: random factors in each naming scheme.

The 8-step mode's file (``neopp_8steps_lora.safetensors``) targets the attention and dense MLP
linears; one more file per naming scheme targets the attention linears only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from neopp.model.lora import SCHEME_SUFFIX, SCHEMES


def tiny_lora_tensors(weights: Mapping[str, torch.Tensor], targets: Iterable[str], scheme: str,
                      rank: int = 4, alpha: float | None = 8.0, seed: int = 7,
                      gain: float = 0.5) -> dict[str, torch.Tensor]:
    """Random factors for `targets` (weight keys) in one naming scheme; the delta is O(gain * W)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}")
    up_sfx, down_sfx = SCHEME_SUFFIX[scheme]
    gen = torch.Generator().manual_seed(seed)
    factor = (alpha / rank) if alpha is not None else 1.0
    out: dict[str, torch.Tensor] = {}
    for key in targets:
        out_f, in_f = weights[key].shape
        base = key[: -len(".weight")]
        out[base + down_sfx] = torch.randn(rank, in_f, generator=gen) / in_f ** 0.5
        out[base + up_sfx] = torch.randn(out_f, rank, generator=gen) * (gain / (factor * rank ** 0.5))
        if alpha is not None:
            out[base + ".alpha"] = torch.tensor(float(alpha))
    return out


def write_tiny_loras(out_dir: str | Path, weights: Mapping[str, torch.Tensor], seed: int = 7) -> dict[str, Path]:
    """`neopp_8steps_lora.safetensors` (the 8-step mode's file) and one file per naming scheme."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    attn = [k for k in weights if k.endswith(("q_proj_mot_gen.weight", "v_proj_mot_gen.weight",
                                              "o_proj_mot_gen.weight"))]
    mlp = [k for k in weights if ".mlp_mot_gen." in k and k.endswith(("up_proj.weight", "down_proj.weight"))
           and ".experts." not in k]
    files = {"neopp_8steps_lora": tiny_lora_tensors(weights, sorted(attn + mlp), "up_down", seed=seed)}
    for i, scheme in enumerate(SCHEMES):
        alpha = None if scheme == "peft" else 2.0 + i
        files[f"lora_{scheme}"] = tiny_lora_tensors(weights, sorted(attn), scheme, rank=2 + i, alpha=alpha,
                                                    seed=seed + 1 + i, gain=0.3)
    paths = {}
    for name, tensors in files.items():
        paths[name] = out / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(paths[name]))
    return paths


def write_adapter(folder: str | Path, name: str, weights: Mapping[str, torch.Tensor], targets: Iterable[str],
                  scheme: str = "up_down", rank: int = 4, seed: int = 11, gain: float = 0.3,
                  prefix: str = "", metadata: dict[str, str] | None = None) -> Path:
    """One adapter file `<name>.safetensors` for a per-request adapter directory; `prefix` is put
    before every key (the official files' `diffusion_model.`)."""
    tensors = tiny_lora_tensors(weights, targets, scheme, rank=rank, alpha=2.0 * rank if scheme != "peft" else None,
                                seed=seed, gain=gain)
    path = Path(folder) / f"{name}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path
