"""Every rule a generation request must meet, each written once.

Both engines (the in-process pipeline and the rank worker pool) hold a :class:`RequestRules`
instead of sharing a base class, and the Triton request parser calls the same checks at its
boundary, so a rule cannot drift between paths. Sampling values carry their own rules
(``SamplingParams.check``). Errors name the request field (``size``, ``index_offset_cond``);
the serving layer spells it as the client's input name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .errors import InputError, shown
from .guidance import guidance_plan
from .kv_cache import validate_kv
from .limits import Limits
from .modes import TASKS, SamplingParams
from .schedule import shifted_timesteps

if TYPE_CHECKING:  # the request type only; importing the pipeline here would be circular
    from .checkpoint_config import CheckpointConfig
    from .pipeline import GenerationRequest


def check_side_bounds(height: int, width: int, limits: Limits, field: str = "size", multiple: int = 1) -> None:
    """Positive sides within ``max_side`` and ``max_pixels``, on Python ints: no size reaches a
    tensor (even a shape-only one) before this passes. ``multiple`` only words the message."""
    if height <= 0 or width <= 0:
        rule = "[height, width] must be positive" if multiple == 1 else \
            f"height and width must each be a positive multiple of {multiple}"
        raise InputError(f"{field}: {rule}, got [{height}, {width}]")
    if max(height, width) > limits.max_side:
        raise InputError(f"{field}: each side must be at most {limits.max_side} pixels (the maximum side), "
                         f"got [{height}, {width}]")
    if height * width > limits.max_pixels:
        raise InputError(f"{field}: {height}x{width} = {height * width} pixels exceeds the maximum of "
                         f"{limits.max_pixels}")


def check_offset(value: int, limits: Limits, field: str) -> None:
    """A RoPE index offset: an integer in 0..max_index_offset."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise InputError(f"{field}: must be an integer, got {shown(value)}")
    if not 0 <= value <= limits.max_index_offset:
        raise InputError(f"{field}: {value} is out of range 0..{limits.max_index_offset}")


def check_steps(steps: int, limits: Limits, field: str = "infer_steps") -> None:
    """The deployment's bound on denoising steps (``SamplingParams`` holds the intrinsic one)."""
    if not 1 <= steps <= limits.max_steps:
        raise InputError(f"{field}: must be in 1..{limits.max_steps}, got {steps}")


def plan_of(sampling: SamplingParams) -> list[bool]:
    """Which steps run guidance for these sampling values."""
    return guidance_plan(sampling, shifted_timesteps(sampling.infer_steps, sampling.timestep_shift))


@dataclass(frozen=True)
class RequestRules:
    """The checks that need the checkpoint's geometry and the deployment's limits."""

    config: CheckpointConfig
    limits: Limits
    support_tasks: tuple[str, ...] = TASKS

    def validate(self, req: GenerationRequest) -> None:
        """Every rule a request can break, checked before any heavy work or noise draw."""
        if req.task not in self.support_tasks:
            raise InputError(f"task: unsupported task {shown(req.task)}; supported: {self.support_tasks}")
        self.check_size(req.height, req.width)
        check_steps(req.sampling.infer_steps, self.limits)
        dims, max_tokens = self.config.kv_dims, self.limits.max_prefix_tokens
        validate_kv(req.cond_kv, dims, "cond_kv", max_tokens)
        check_offset(req.index_offset_cond, self.limits, "index_offset_cond")
        if req.uncond_kv is not None:
            validate_kv(req.uncond_kv, dims, "uncond_kv", max_tokens)
            if req.index_offset_uncond is None:
                raise InputError("index_offset_uncond: required when uncond_kv is given")
            check_offset(req.index_offset_uncond, self.limits, "index_offset_uncond")
        if any(plan_of(req.sampling)) and req.uncond_kv is None:
            raise InputError(f"uncond_kv: required because guidance is on for some steps "
                             f"(cfg_scale {req.sampling.cfg_scale} > 1 inside cfg_interval "
                             f"{req.sampling.cfg_interval}); send it, or set cfg_scale <= 1")

    def check_size(self, height: int, width: int, field: str = "size") -> None:
        """Bounds, then what the checkpoint needs: whole tokens and enough vision positions."""
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (height, width)):
            raise InputError(f"{field}: height and width must be integers, got {shown((height, width))}")
        t = self.config.token_size
        check_side_bounds(height, width, self.limits, field, t)
        for what, v in (("height", height), ("width", width)):
            if v % t:
                raise InputError(f"{field}: {what} must be a positive multiple of {t}, got {v}")
        max_patches = self.config.max_position_embeddings_vision
        if max(height, width) // self.config.patch_size > max_patches:
            raise InputError(f"{field}: {max(height, width)} pixels exceed the vision positions of the checkpoint "
                             f"({max_patches} patches of {self.config.patch_size})")
