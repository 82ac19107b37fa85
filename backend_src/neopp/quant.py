"""FP8 (e4m3) weights with one float32 scale per output channel (the `fp8-sgl` scheme)."""

from __future__ import annotations

import torch

from .checkpoint import FP8_DTYPE, LM

FP8_MAX = 448.0


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """absmax / 448 per output row; returns (float8 weight, float32 scale [out])."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def is_layer_linear(key: str) -> bool:
    """Decoder-layer projection weights: the ones the FP8 mode quantises (router excluded)."""
    return (key.startswith(LM + "layers.") and key.endswith("_proj_mot_gen.weight")) or (
        key.startswith(LM + "layers.") and ".mlp_mot_gen." in key and key.endswith("_proj.weight"))


def quantize_checkpoint_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A pre-quantised checkpoint: layer linears in FP8 plus `<name>.weight_scale`."""
    out = dict(tensors)
    for key, w in tensors.items():
        if is_layer_linear(key) and "mot_gen" in key:
            out[key], out[key + "_scale"] = quantize_fp8(w)
    return out
