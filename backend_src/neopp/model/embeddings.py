"""Tokens in and out of the tower: patch and time embeddings (pre-infer), heads (post-infer)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .layers import Linear
from .rope import apply_vision_rope, vision_rope_tables


@dataclass(frozen=True)
class Grid:
    """Image geometry of one request: pixels, tokens per side, and its patch RoPE tables."""

    height: int
    width: int
    token_size: int
    vision_cos: torch.Tensor
    vision_sin: torch.Tensor

    @property
    def rows(self) -> int:
        return self.height // self.token_size

    @property
    def cols(self) -> int:
        return self.width // self.token_size

    @property
    def num_tokens(self) -> int:
        return self.rows * self.cols

    @staticmethod
    def build(height: int, width: int, patch: int, merge: int, vision_dim: int, theta: float,
              device: torch.device) -> Grid:
        cos, sin = vision_rope_tables(height // patch, width // patch, vision_dim, theta)
        return Grid(height, width, patch * merge, cos.to(device), sin.to(device))


def patchify(x: torch.Tensor, t: int) -> torch.Tensor:
    """[1, 3, H, W] -> [L, T*T*3]: T x T cells, row-major, each flattened channel-last."""
    _, c, height, width = x.shape
    h, w = height // t, width // t
    return x[0].view(c, h, t, w, t).permute(1, 3, 2, 4, 0).reshape(h * w, t * t * c)


def unpatchify(z: torch.Tensor, height: int, width: int, t: int) -> torch.Tensor:
    h, w = height // t, width // t
    return z.view(h, w, t, t, 3).permute(4, 0, 2, 1, 3).reshape(1, 3, height, width)


def sinusoid(value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """256-wide [cos(v f), sin(v f)] with f_j = exp(-ln(1e4) j / 128); v is fed unscaled.
    A tensor of values gives one row per value (training embeds a batch of times)."""
    freqs = torch.exp(-math.log(10000.0) * torch.arange(128, dtype=torch.float64) / 128)
    args = torch.as_tensor(value, dtype=torch.float64).cpu()[..., None] * freqs
    return torch.cat([args.cos(), args.sin()], dim=-1).float().to(device)


class MLPEmbedder:
    def __init__(self, fc1: Linear, fc2: Linear) -> None:
        self.fc1, self.fc2 = fc1, fc2

    def __call__(self, value: float, dtype: torch.dtype) -> torch.Tensor:
        freq = sinusoid(value, self.fc1.weight.device).to(dtype)
        return self.fc2(F.silu(self.fc1(freq)))


class PatchEmbed:
    """16x16 patch conv + GELU + 2-D RoPE, then the 2x2 merge conv to image tokens."""

    def __init__(self, patch_w, patch_b, dense_w, dense_b, patch_size: int) -> None:
        self.patch_w, self.patch_b, self.dense_w, self.dense_b = patch_w, patch_b, dense_w, dense_b
        self.patch_size = patch_size

    def __call__(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        p = self.patch_size
        feats = F.conv2d(x, self.patch_w, self.patch_b, stride=p)           # [1, DV, H/16, W/16]
        _, dv, rows, cols = feats.shape
        seq = F.gelu(feats.flatten(2)[0].t())                                # [N16, DV]
        seq = apply_vision_rope(seq, grid.vision_cos, grid.vision_sin)
        feats = seq.t().reshape(1, dv, rows, cols)
        merge = self.dense_w.shape[-1]
        tokens = F.conv2d(feats, self.dense_w, self.dense_b, stride=merge)   # [1, D, h, w]
        return tokens.flatten(2)[0].t()                                      # [L, D]


class MLPHead:
    def __init__(self, fc1: Linear, fc2: Linear) -> None:
        self.fc1, self.fc2 = fc1, fc2

    def __call__(self, hid: torch.Tensor, grid: Grid) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(hid)))


class PixelHead:
    """Tokens -> pixels through two convs and three pixel shuffles, then cut like `z`."""

    def __init__(self, conv1_w, conv1_b, conv2_w, conv2_b) -> None:
        self.conv1_w, self.conv1_b, self.conv2_w, self.conv2_b = conv1_w, conv1_b, conv2_w, conv2_b

    def __call__(self, hid: torch.Tensor, grid: Grid) -> torch.Tensor:
        return patchify(self.image(hid.t().reshape(1, hid.shape[1], grid.rows, grid.cols)), grid.token_size)

    def image(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens laid on their grid [B, D, rows, cols] -> pixels [B, 3, H, W] (training runs batches)."""
        img = F.gelu(F.conv2d(F.pixel_shuffle(tokens, 2), self.conv1_w, self.conv1_b, padding=1))
        img = F.conv2d(F.pixel_shuffle(img, 2), self.conv2_w, self.conv2_b, padding=1)
        return F.pixel_shuffle(img, 8)
