"""The benchmark's PSNR and SSIM against window-by-window sums written out in plain Python."""

from __future__ import annotations

import math

import numpy as np

from bench.image_metrics import C1, C2, WINDOW, gaussian_window, psnr, ssim


def slow_ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Every valid window, every channel: weighted means, variances and covariance by explicit sums."""
    w, h, width = gaussian_window(), a.shape[0], a.shape[1]
    values = []
    for c in range(a.shape[2]):
        x, y = a[..., c].astype(np.float64), b[..., c].astype(np.float64)
        for i in range(h - WINDOW + 1):
            for j in range(width - WINDOW + 1):
                px, py = x[i:i + WINDOW, j:j + WINDOW], y[i:i + WINDOW, j:j + WINDOW]
                mx, my = (w * px).sum(), (w * py).sum()
                vx, vy = (w * (px - mx) ** 2).sum(), (w * (py - my) ** 2).sum()
                cxy = (w * (px - mx) * (py - my)).sum()
                values.append((2 * mx * my + C1) * (2 * cxy + C2) / ((mx**2 + my**2 + C1) * (vx + vy + C2)))
    return float(np.mean(values))


def test_ssim_matches_the_window_sums_and_its_bounds():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (16, 14, 3), dtype=np.uint8)
    b = np.clip(a.astype(int) + rng.integers(-40, 41, a.shape), 0, 255).astype(np.uint8)
    # float64 both ways; E[x^2] - E[x]^2 against the centred sum loses ~1e-12 relative, far below 1e-9
    assert abs(ssim(a, b) - slow_ssim(a, b)) < 1e-9
    assert ssim(a, a) == 1.0 and ssim(a, b) < 0.99
    assert ssim(a, 255 - a) < 0  # an inverted picture: its structure anti-correlated


def test_psnr_of_a_known_error():
    a = np.zeros((4, 4, 3), np.uint8)
    b = a + 5  # mse 25
    assert math.isclose(psnr(b, a), 10 * math.log10(255**2 / 25))
    assert psnr(a, a) == math.inf
