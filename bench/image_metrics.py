"""PSNR and SSIM of uint8 pictures against a reference picture, written plainly (no extra package).

SSIM follows Wang et al. (2004): an 11x11 Gaussian window (sigma 1.5), constants
``(0.01 L)^2`` and ``(0.03 L)^2`` with ``L = 255``, the map averaged over the windows that fit
inside the image ("valid"), per colour channel, then over the channels.
"""

from __future__ import annotations

import math

import numpy as np
import torch

WINDOW, SIGMA = 11, 1.5
C1, C2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2


def psnr(got: np.ndarray, want: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB (inf for identical pictures)."""
    mse = float(np.mean((got.astype(np.float64) - want.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(255.0**2 / mse)


def gaussian_window(size: int = WINDOW, sigma: float = SIGMA) -> np.ndarray:
    """The normalised 2-D window, the outer product of a 1-D Gaussian with itself."""
    x = np.arange(size, dtype=np.float64) - (size - 1) / 2
    g = np.exp(-(x**2) / (2 * sigma**2))
    g /= g.sum()
    return np.outer(g, g)


def ssim(got: np.ndarray, want: np.ndarray) -> float:
    """Mean SSIM of two [H, W, 3] uint8 pictures (each side at least ``WINDOW``)."""
    w = torch.from_numpy(gaussian_window())[None, None]

    def blur(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.conv2d(x, w)

    a = torch.from_numpy(got.astype(np.float64)).permute(2, 0, 1)[:, None]  # channels as a batch
    b = torch.from_numpy(want.astype(np.float64)).permute(2, 0, 1)[:, None]
    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a**2
    var_b = blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    num = (2 * mu_a * mu_b + C1) * (2 * cov + C2)
    den = (mu_a**2 + mu_b**2 + C1) * (var_a + var_b + C2)
    return float((num / den).mean())
