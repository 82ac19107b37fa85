"""The shifted time grid of the denoising steps and the initial noise scale."""

from __future__ import annotations

import math

from ..model.checkpoint_config import SIZE_SCALED_NOISE_MODES, CheckpointConfig


def shifted_timesteps(steps: int, shift: float) -> list[float]:
    """`N + 1` times from 0 (noise) to 1 (clean), warped by the shift; step k goes t[k] -> t[k+1]."""
    out = []
    for k in range(steps + 1):
        sigma = 1.0 - k / steps
        sigma = shift * sigma / (1.0 + (shift - 1.0) * sigma)
        out.append(1.0 - sigma)
    return out


def initial_noise_scale(config: CheckpointConfig, num_tokens: int) -> float:
    """How loud the starting noise is: capped at `noise_scale_max_value` in every mode.

    "resolution" and its alias "dynamic" scale `noise_scale` by sqrt(tokens / base), so larger
    images start louder; "dynamic_sqrt" takes the square root of that; "constant" (and, as
    upstream, any other name) keeps `noise_scale` as given.
    """
    scale = config.noise_scale
    if config.noise_scale_mode in SIZE_SCALED_NOISE_MODES:
        scale *= math.sqrt(num_tokens / config.noise_scale_base_image_seq_len)
        if config.noise_scale_mode == "dynamic_sqrt":
            scale = math.sqrt(scale)
    return min(scale, config.noise_scale_max_value)
