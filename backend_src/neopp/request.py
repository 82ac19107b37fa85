"""One generation request as data, and the bounds of its values that need no checkpoint.

The rules that need the checkpoint's geometry and the request's step plan are
``neopp.sampling.plan.RequestRules``'s; sampling values carry their own
(``SamplingParams.check``). Errors name the request field (``size``, ``index_offset_cond``);
the serving layer spells it as the client's input name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .contract.inputs import MAX_THINK_TOKENS
from .errors import InputError, shown
from .limits import Limits
from .modes import SamplingParams

if TYPE_CHECKING:  # the request's fields are tensors; checking bounds needs no torch
    import torch

# The guidance branches a request may carry: its prompt, the empty prompt, and (image editing)
# the input images without the prompt.
COND, UNCOND, IMAGE = "cond", "uncond", "image"


@dataclass
class GenerationRequest:
    """One image to generate; ``noise`` is drawn only once the request has passed validation."""

    cond_kv: torch.Tensor
    index_offset_cond: int
    height: int
    width: int
    noise: torch.Tensor | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    uncond_kv: torch.Tensor | None = None
    index_offset_uncond: int | None = None
    task: str = "t2i"
    noise_scaled: bool = False  # True: ``noise`` is the starting state itself (LightX2V draws it scaled)
    image_kv: torch.Tensor | None = None  # image-editing guidance: the input images without the prompt
    index_offset_image: int | None = None
    lora: str | None = None  # an adapter's name in the model's adapter directory; None: the base model
    lora_scale: float = 1.0
    lane: str = ""  # the client lane it waits in (neopp.contract.client_lanes): the scheduler takes turns between lanes
    # The adapter itself, when an engine loaded it on accepting the request (off its step thread)
    adapter: Any = field(default=None, repr=False, compare=False)

    @property
    def image_editing(self) -> bool:
        """Image-editing guidance is selected by sending the image branch. A CFG rank that does
        not run that branch gets its offset without the KV, so it plans the same steps."""
        return self.image_kv is not None or self.index_offset_image is not None

    def branch_input(self, name: str) -> tuple[torch.Tensor | None, int | None]:
        """The prefix and index offset of branch ``name`` (cond, uncond or image)."""
        return {COND: (self.cond_kv, self.index_offset_cond), UNCOND: (self.uncond_kv, self.index_offset_uncond),
                IMAGE: (self.image_kv, self.index_offset_image)}[name]


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


def check_think_tokens(value: int) -> int:
    """Think mode's cap on the reasoning's tokens (``THINK_MAX_TOKENS``)."""
    if not 1 <= value <= MAX_THINK_TOKENS:
        raise InputError(f"THINK_MAX_TOKENS: must be in 1..{MAX_THINK_TOKENS}, got {value}")
    return value
