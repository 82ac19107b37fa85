"""Classifier-free guidance: when a step uses it and how two velocities combine."""

from __future__ import annotations

import torch

from .errors import InputError
from .modes import SamplingParams


def uses_guidance(sampling: SamplingParams, t: float) -> bool:
    low, high = sampling.cfg_interval
    return sampling.enable_cfg and sampling.cfg_scale > 1.0 and low <= t <= high


def guidance_plan(sampling: SamplingParams, times: list[float]) -> list[bool]:
    """Per step: whether it needs the uncond branch (so unused guidance costs nothing)."""
    return [uses_guidance(sampling, t) for t in times[:-1]]


def combine_guidance(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float, norm: str) -> torch.Tensor:
    """`v_u + s (v_c - v_u)`, then the norm-ratio clamp; inputs are [tokens, channels]."""
    v = torch.lerp(v_uncond, v_cond, scale)  # v_u + s (v_c - v_u), one allocation
    if norm == "global":
        ratio = v_cond.norm() / (v.norm() + 1e-8)
        return v.mul_(ratio.clamp(0.0, 1.0))
    if norm == "channel":
        ratio = v_cond.norm(dim=-1, keepdim=True) / (v.norm(dim=-1, keepdim=True) + 1e-8)
        return v.mul_(ratio.clamp(0.0, 1.0))
    if norm == "none":
        return v
    raise InputError(f"cfg_norm: unknown normalisation {norm!r}")
