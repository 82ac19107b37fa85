"""The flow-matching Euler sampler: the starting state, the velocity, the step and its check.

The pipeline, the step batcher and every rank call this one object (as a diffusers scheduler
owns ``step``), so the update, the clamp of ``1 - t`` and the finite check cannot drift apart.
The state is float32 whatever dtype the tower runs in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InputError, NonFiniteState
from ..request import GenerationRequest

# The velocity divides by 1 - t; near the clean end that is clamped so the last step stays finite.
MIN_ONE_MINUS_T = 0.02


def to_pixels(x: torch.Tensor) -> np.ndarray:
    """[1, 3, H, W] normalised estimate -> uint8 [H, W, 3]."""
    img = (x[0].float() * 0.5 + 0.5).clamp(0.0, 1.0) * 255.0
    return img.round().to(torch.uint8).permute(1, 2, 0).contiguous().cpu().numpy()


@dataclass
class StepEvent:
    """One report of one request: ``step`` steps of ``total`` are done.

    ``preview`` (uint8 [H, W, 3], full size) is set on the steps the request asked a preview
    for; ``final`` (uint8 [H, W, 3]) on the last event; ``error`` ends a request that failed or
    was cancelled (then nothing else follows). ``seconds``: the step's wall time, where known.
    """

    step: int
    total: int
    preview: np.ndarray | None = None
    final: np.ndarray | None = None
    error: Exception | None = None
    seconds: float = 0.0

    @property
    def last(self) -> bool:
        return self.final is not None or self.error is not None


@dataclass(frozen=True)
class FlowSampler:
    """Euler steps along ``times`` (0 = noise, 1 = clean) from noise scaled by ``noise_scale``."""

    times: tuple[float, ...]
    noise_scale: float

    @property
    def steps(self) -> int:
        return len(self.times) - 1

    def start(self, req: GenerationRequest, device: torch.device) -> torch.Tensor:
        """The starting state [1, 3, H, W]: the request's noise, scaled unless it already is."""
        if req.noise is None or tuple(req.noise.shape) != (1, 3, req.height, req.width):
            raise InputError(f"noise: must be drawn with shape (1, 3, {req.height}, {req.width}) before sampling")
        x = req.noise.to(torch.float32)
        if not req.noise_scaled:
            x = x * self.noise_scale
        return x.to(device)

    def velocity(self, x_pred: torch.Tensor, z: torch.Tensor, k: int) -> torch.Tensor:
        """`(x_pred - z) / max(1 - t_k, 0.02)` from the tower's clean-image prediction, a fresh
        tensor that this writes in place (no temporaries)."""
        return x_pred.float().sub_(z).div_(max(1.0 - self.times[k], MIN_ONE_MINUS_T))

    def clean_estimate(self, z: torch.Tensor, v: torch.Tensor, k: int) -> torch.Tensor:
        """The clean image that step k's (guided) velocity points at: a preview."""
        return z + max(1.0 - self.times[k], MIN_ONE_MINUS_T) * v

    def step(self, z: torch.Tensor, v: torch.Tensor, k: int) -> None:
        """Move the state ``z`` from t_k to t_k+1 in place, then refuse a non-finite state."""
        z.add_(v, alpha=self.times[k + 1] - self.times[k])
        check_finite(z, k + 1, self.steps)


def check_finite(state: torch.Tensor, step: int, steps: int) -> None:
    """Refuse to go on once the state holds inf or NaN (it would decode to a flat image).

    One reduction per step: the sum is finite only if every element is (a finite sum can
    overflow only for values no sane state reaches, which is just as wrong).
    """
    if not bool(torch.isfinite(state.sum())):
        raise NonFiniteState(
            f"cond_kv: the denoising state stopped being finite (inf or NaN) at step {step} of {steps}; "
            "the request's values (KV prefix magnitudes, CFG_SCALE) drive the model out of range, "
            "so no image is returned")
