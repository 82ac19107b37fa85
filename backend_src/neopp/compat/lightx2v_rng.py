"""LightX2V's randomness, so that LightLLM's save/restore of the global RNG state works.

LightX2V seeds every global generator for an integer seed and otherwise leaves them as the
caller set them; the starting noise is one draw from the global generator of the run's
device, in bfloat16, scaled there. LightLLM relies on exactly that: it restores a session's
saved global state and passes ``seed=None`` to continue the session. The server's own
streams (``SEED`` / ``RNG_STATE``) are a different, device-independent rule; over Triton
this facade sends its draw as the ``NOISE`` input instead.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from ..errors import InputError, shown

SEED_RANGE = (0, 2**32 - 1)  # numpy's global seed accepts no more


def seed_all(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators (every CUDA device's too)."""
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise InputError(f"seed: must be an integer or None, got {shown(seed)}")
    low, high = SEED_RANGE
    if not low <= int(seed) <= high:
        raise InputError(f"seed: must be in {low}..{high} (numpy's global seed range), got {seed}")
    seed = int(seed)
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def draw_start(height: int, width: int, noise_scale: float, device: torch.device | str) -> torch.Tensor:
    """The starting state ``noise_scale * randn([1, 3, H, W])``, bfloat16, from ``device``'s global generator."""
    return noise_scale * torch.randn((1, 3, height, width), device=device, dtype=torch.bfloat16)
