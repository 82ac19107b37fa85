"""GGUF's block-quantized weights, dequantized in torch.

A quantized weight is stored row by row as fixed-size blocks of bytes; each block holds a few
float16 scales and packed integers for ``size`` consecutive values of its row. A weight stays in
memory as those bytes (a quarter to a half of bf16), and a layer turns it back into floats when
it runs. The layouts are GGUF's own (ggml's ``block_q8_0``, ``block_q4_0``, ``block_q4_K``,
``block_q5_K``, ``block_q6_K``); the arithmetic keeps ggml's order of operations in float32, so a
dequantized weight equals the reference reader's bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockType:
    """A quantization type: values per block, bytes per block, and how a block becomes floats."""

    name: str
    size: int
    nbytes: int
    values: Callable[[torch.Tensor], torch.Tensor]  # [blocks, nbytes] uint8 -> [blocks, size] float32


def _half(raw: torch.Tensor) -> torch.Tensor:
    """Two bytes per row (little-endian float16) -> [blocks, 1] float32."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Each byte's low nibbles, then its high ones, along the last axis."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    scale = _half(blocks[:, :2])
    return blocks[:, 2:].contiguous().view(torch.int8).float() * scale


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    scale = _half(blocks[:, :2])
    return scale * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of a K block's 12 bytes: the first four sub-blocks' in the
    low six bits of bytes 0-3 and 4-7, the last four's low nibbles in bytes 8-11, their top two
    bits in the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    head, mid, tail = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([head & 0x3F, (tail & 0x0F) | ((head >> 6) << 4)], dim=-1)
    mins = torch.cat([mid & 0x3F, (tail >> 4) | ((mid >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``(d * scale) * q - (dmin * min)`` per 32-value sub-block; ``q`` is [blocks, 8, 32]."""
    d, dmin = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])
    scales, mins = _k_scales(blocks[:, 4:16])
    return ((d * scales)[..., None] * q - (dmin * mins)[..., None]).reshape(len(blocks), 256)


def _low_high(packed: torch.Tensor) -> torch.Tensor:
    """128 bytes -> [blocks, 8, 32] 4-bit values: each 32-byte group gives two sub-blocks, its low
    nibbles first."""
    groups = packed.reshape(len(packed), 4, 1, 32)
    return torch.cat([groups & 0x0F, groups >> 4], dim=2).reshape(len(packed), 8, 32)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_affine(blocks, _low_high(blocks[:, 16:144]).float())


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    high = blocks[:, 16:48]  # sub-block j's fifth bits are bit j of these 32 bytes
    fifth = torch.stack([(high >> j) & 1 for j in range(8)], dim=1)
    return _k_affine(blocks, (_low_high(blocks[:, 48:176]) | (fifth << 4)).float())


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Two halves of 128 values: four runs of 32 per half, from the low nibbles of ``ql``'s 64
    bytes, then their high nibbles; two more bits each from ``qh``'s 32 bytes (bits 0-1, 2-3,
    4-5, 6-7 for the four runs); minus 32; an int8 scale per 16 values."""
    n = len(blocks)
    low = _nibbles(blocks[:, 0:128].reshape(n, 2, 64))
    high = blocks[:, 128:192].reshape(n, 2, 1, 32)
    two = torch.cat([(high >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=2).reshape(n, 2, 128)
    q = ((low | (two << 4)).to(torch.int8) - 32).float().reshape(n, 16, 16)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _half(blocks[:, 208:210])
    return ((d * scales)[..., None] * q).reshape(n, 256)


BLOCK_TYPES = {t.name: t for t in (
    BlockType("Q8_0", 32, 34, _q8_0),
    BlockType("Q4_0", 32, 18, _q4_0),
    BlockType("Q4_K", 256, 144, _q4_k),
    BlockType("Q5_K", 256, 176, _q5_k),
    BlockType("Q6_K", 256, 210, _q6_k),
)}


def dequantize(raw: torch.Tensor, kind: str, shape: tuple[int, int]) -> torch.Tensor:
    """A [rows, columns] float32 weight from its stored bytes (uint8, rows x bytes per row)."""
    block = BLOCK_TYPES[kind]
    values = block.values(raw.reshape(-1, block.nbytes))
    return values.reshape(shape)


def stored_bytes(kind: str, shape: tuple[int, int]) -> int:
    """The bytes a weight of ``shape`` takes in ``kind``; its rows must be whole blocks."""
    block = BLOCK_TYPES[kind]
    rows, columns = shape
    if columns % block.size:
        raise ValueError(f"a row of {columns} values is not whole {kind} blocks of {block.size}")
    return rows * columns // block.size * block.nbytes
