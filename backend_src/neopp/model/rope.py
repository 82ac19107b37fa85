"""Rotary position tables: 2-D interleaved for patches, 3-D rotate-half for image tokens.

Tables are built once per request (they depend on the grid and the branch's offset, not on
the step) and applied in float32, whatever the model's dtype.
"""

from __future__ import annotations

import torch


def vision_rope_tables(rows: int, cols: int, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [rows*cols, 2, dim/4]: half 0 turns with the column, half 1 with the row."""
    quarter = dim // 4
    freqs = 1.0 / theta ** (torch.arange(quarter, dtype=torch.float64) * 2.0 / (dim // 2))
    r = torch.arange(rows, dtype=torch.float64).repeat_interleave(cols)
    c = torch.arange(cols, dtype=torch.float64).repeat(rows)
    angles = torch.stack([c[:, None] * freqs, r[:, None] * freqs], dim=1)
    return angles.cos().float(), angles.sin().float()


def apply_vision_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (2j, 2j+1) of each half of x [N, dim]."""
    n, dim = x.shape
    pairs = x.float().view(n, 2, dim // 4, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return out.view(n, dim).to(x.dtype)


class Rope3D:
    """Temporal / row / column rotate-half segments of one head, for one branch's tokens."""

    def __init__(self, offset: int, rows: int, cols: int, head_dim: int, theta: float, theta_hw: float,
                 device: torch.device) -> None:
        r = torch.arange(rows, dtype=torch.float64).repeat_interleave(cols)
        c = torch.arange(cols, dtype=torch.float64).repeat(rows)
        t = torch.full((rows * cols,), float(offset), dtype=torch.float64)
        self._build(t, r, c, head_dim, theta, theta_hw, device)

    @classmethod
    def text(cls, length: int, head_dim: int, theta: float, theta_hw: float, device: torch.device,
             start: int = 0) -> Rope3D:
        """Prompt tokens: temporal index start..start+length-1, both spatial indices 0 (text has no grid)."""
        zeros = [0] * length
        return cls.at(list(range(start, start + length)), zeros, zeros, head_dim, theta, theta_hw, device)

    @classmethod
    def at(cls, t: list[int], rows: list[int], cols: list[int], head_dim: int, theta: float, theta_hw: float,
           device: torch.device) -> Rope3D:
        """Tokens at given (t, row, column) positions: a prompt whose pictures sit among its words."""
        rope = object.__new__(cls)
        rope._build(*(torch.tensor(v, dtype=torch.float64) for v in (t, rows, cols)), head_dim, theta, theta_hw,
                    device)
        return rope

    def _build(self, t: torch.Tensor, r: torch.Tensor, c: torch.Tensor, hd: int, theta: float, theta_hw: float,
               device: torch.device) -> None:
        ft = 1.0 / theta ** (torch.arange(hd // 4, dtype=torch.float64) * 4.0 / hd)
        fs = 1.0 / theta_hw ** (torch.arange(hd // 8, dtype=torch.float64) * 8.0 / hd)
        segments = [t[:, None] * ft, r[:, None] * fs, c[:, None] * fs]
        angles = torch.cat([torch.cat([s, s], dim=1) for s in segments], dim=1)
        self.perm, sign = _rotate_half_index(hd, device)
        self.cos = angles.cos().float().to(device)[:, None, :]
        self.sin = angles.sin().float().to(device)[:, None, :] * sign  # rotate-half signs folded in

    @classmethod
    def _from_tables(cls, cos: torch.Tensor, sin: torch.Tensor, perm: torch.Tensor) -> Rope3D:
        rope = object.__new__(cls)
        rope.cos, rope.sin, rope.perm = cos, sin, perm
        return rope

    def padded_slice(self, total: int, start: int, stop: int) -> Rope3D:
        """Tables extended to `total` tokens with identity rotations (padding), then sliced."""
        pad = total - self.cos.shape[0]
        cos = torch.cat([self.cos, torch.ones_like(self.cos[:1]).expand(pad, -1, -1)])
        sin = torch.cat([self.sin, torch.zeros_like(self.sin[:1]).expand(pad, -1, -1)])
        return self._from_tables(cos[start:stop], sin[start:stop], self.perm)

    @classmethod
    def concat(cls, ropes: list[Rope3D]) -> Rope3D:
        """Several branches' tokens one after the other (batched CFG)."""
        return cls._from_tables(torch.cat([r.cos for r in ropes]), torch.cat([r.sin for r in ropes]),
                                ropes[0].perm)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim] -> rotated, same dtype."""
        xf = x.float()
        return (xf * self.cos + xf.index_select(-1, self.perm) * self.sin).to(x.dtype)


def _rotate_half_index(hd: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.empty(hd, dtype=torch.long)
    sign = torch.empty(hd, dtype=torch.float32)
    for start, size in ((0, hd // 2), (hd // 2, hd // 4), (3 * hd // 4, hd // 4)):
        half = size // 2
        for i in range(half):
            perm[start + i], sign[start + i] = start + half + i, -1.0
            perm[start + half + i], sign[start + half + i] = start + i, 1.0
    return perm.to(device), sign.to(device)
