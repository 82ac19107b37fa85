"""Classifier-free guidance: which steps use it, which branches they run, how velocities combine.

Two rules, both written once here:

* text-to-image (no image branch): cond + uncond, `v_u + s (v_c - v_u)`, guided where
  `low <= t <= high` and `cfg_scale > 1`;
* image editing (the request carries an image branch: the input images without the prompt):
  up to three branches chosen by the two scales, guided where `low < t < high` (open) or
  `low == 0`, as SenseNova-U1's image-editing sampler does.

Both apply only when the mode's ``enable_cfg`` is true; an unguided step uses `v_c` alone.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import InputError
from ..modes import SamplingParams
from ..request import COND, IMAGE, UNCOND


def uses_guidance(sampling: SamplingParams, t: float, image: bool = False) -> bool:
    """Does the step at time t combine branches? ``image``: the request is an image edit."""
    if not sampling.enable_cfg:
        return False
    low, high = sampling.cfg_interval
    if not image:
        return sampling.cfg_scale > 1.0 and low <= t <= high
    if sampling.cfg_scale == 1.0 and sampling.image_guidance_scale == 1.0:
        return False
    return low < t < high or low == 0.0


def guidance_plan(sampling: SamplingParams, times: list[float], image: bool = False) -> list[bool]:
    """Per step: whether it runs more than the cond branch (so unused guidance costs nothing)."""
    return [uses_guidance(sampling, t, image) for t in times[:-1]]


def guided_branches(sampling: SamplingParams, image: bool = False) -> tuple[str, ...]:
    """The branches a guided step runs, cond first; only those a formula below reads."""
    if not image:
        return (COND, UNCOND)
    s, s_img = sampling.cfg_scale, sampling.image_guidance_scale
    if s_img == 1.0:
        return (COND, IMAGE)
    if s == s_img:
        return (COND, UNCOND)
    return (COND, UNCOND, IMAGE)


def combine(v: Mapping[str, torch.Tensor], sampling: SamplingParams, image: bool = False) -> torch.Tensor:
    """The guided velocity of one step from its branches' velocities ([tokens, channels] each)."""
    s, s_img, norm = sampling.cfg_scale, sampling.image_guidance_scale, sampling.cfg_norm
    names = guided_branches(sampling, image)
    v_c = v[COND]
    if names == (COND, UNCOND):
        out = torch.lerp(v[UNCOND], v_c, s)  # v_u + s (v_c - v_u)
    elif names == (COND, IMAGE):
        out = torch.lerp(v[IMAGE], v_c, s)  # v_i + s (v_c - v_i)
    else:  # v_u + s (v_c - v_i) + s_img (v_i - v_u)
        v_u, v_i = v[UNCOND], v[IMAGE]
        out = (v_c - v_i).mul_(s).add_(v_u).add_(v_i - v_u, alpha=s_img)
    if image and not (s > 1.0 or s_img > 1.0):
        return out  # the image-editing sampler clamps only when a scale exceeds 1
    return norm_clamp(out, v_c, norm)


def norm_clamp(v: torch.Tensor, v_cond: torch.Tensor, norm: str) -> torch.Tensor:
    """Scale the guided velocity down (never up) to the cond velocity's norm, in place."""
    if norm == "global":
        ratio = v_cond.norm() / (v.norm() + 1e-8)
        return v.mul_(ratio.clamp(0.0, 1.0))
    if norm == "channel":
        ratio = v_cond.norm(dim=-1, keepdim=True) / (v.norm(dim=-1, keepdim=True) + 1e-8)
        return v.mul_(ratio.clamp(0.0, 1.0))
    if norm == "none":
        return v
    raise InputError(f"cfg_norm: unknown normalisation {norm!r}")
