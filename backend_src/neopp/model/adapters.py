"""LoRA adapters applied unmerged, per row group of a step batch.

A merged LoRA changes the weights for every request; an adapter held apart changes only the
rows of the requests that name it. The batched forward knows which token rows belong to which
request (``RowGroup``); while ``row_adapters`` is active, every decoder-layer linear adds, for
each group whose adapter targets it, ``scale * (alpha / rank) * (x[rows] A^T) B^T`` to its own
output rows. The base projection (bf16, float32 or FP8) is computed exactly as without adapters,
so rows without an adapter keep today's bytes; the low-rank products run on the group's rows
alone, tiled like the base product on the CPU, so a request's bytes do not depend on who shares
its batch.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError
from .checkpoint import LM, layer_prefix
from .layers import ROW_ADAPTERS, Linear
from .safetensors_header import Stamp, key_shown

if TYPE_CHECKING:
    from .lora import LoraHeader

MLP_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}  # checkpoint name -> SwiGLU part
ATTENTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj")
# The keys of ``tower_linears``, spelled as one pattern (a test holds the two to one set)
ADAPTER_TARGET = re.compile(
    rf"{re.escape(LM)}layers\.[0-9]+\."
    rf"(self_attn\.({'|'.join(ATTENTION_NAMES)})_mot_gen|mlp_mot_gen\.(experts\.[0-9]+\.)?({'|'.join(MLP_NAMES)}))"
    r"\.weight")


@dataclass
class Factors:
    """One target linear's factors: ``down`` (A, [rank, in]) and ``up`` (B, [out, rank]) in the
    model's dtype and device, and ``alpha / rank``."""

    down: torch.Tensor
    up: torch.Tensor
    factor: float


@dataclass
class Adapter:
    """A loaded adapter: its factors by target linear (the tower's own objects), the sampling
    values it recommends, the file it was read from, and the bytes it holds."""

    name: str
    factors: dict[Linear, Factors]
    recommended: dict[str, object] = field(default_factory=dict)
    stamp: Stamp | None = None  # the file it was read from (device, inode, size, mtime_ns)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for f in self.factors.values() for t in (f.down, f.up))

    @property
    def rank(self) -> int:
        return max((int(f.down.shape[0]) for f in self.factors.values()), default=0)


def tower_linears(tower: object) -> dict[str, Linear]:
    """Checkpoint weight key -> the decoder-layer linear built from it (what an adapter targets)."""
    out: dict[str, Linear] = {}
    for i, layer in enumerate(tower.layers):
        attn = layer_prefix(i) + "self_attn."
        for name in ATTENTION_NAMES:
            out[f"{attn}{name}_mot_gen.weight"] = getattr(layer, name)
        mlp = layer_prefix(i) + "mlp_mot_gen."
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            out.update({f"{mlp}{n}.weight": getattr(layer.mlp, part) for n, part in MLP_NAMES.items()})
        else:
            for j, expert in enumerate(experts):
                out.update({f"{mlp}experts.{j}.{n}.weight": getattr(expert, part) for n, part in MLP_NAMES.items()})
    return out


def is_adapter_target(key: str) -> bool:
    """Whether a checkpoint key is the weight of a linear that ``tower_linears`` offers an adapter:
    lets a model judge adapter files from its checkpoint's headers, before (or without) a tower."""
    return ADAPTER_TARGET.fullmatch(key) is not None


def judge_adapter(header: LoraHeader, shapes: Mapping[str, tuple[int, ...]], itemsize: int,
                  max_bytes: int | None) -> None:
    """Whether a judged header is an adapter this tower takes per request: every target one of its
    attention or dense MLP linears (``shapes``, key -> weight shape) with factors of its shape, and
    its factors within ``max_bytes`` at ``itemsize`` bytes each. ConfigError naming the rule."""
    from .lora import check_fit  # lora imports quant, which imports this package's layers

    for plan in header.plans.values():
        if ".experts." in check_fit(plan, shapes):
            raise ConfigError(f"key {key_shown(plan.up.key)} targets a routed expert; an adapter applied per "
                              "request takes attention and dense MLP linears only (merge it in a mode file instead)")
    need = sum(p.numel for p in header.plans.values()) * itemsize
    if max_bytes is not None and need > max_bytes:
        raise ConfigError(f"takes {need} bytes in the model's dtype, over this model's adapter memory bound of "
                          f"{max_bytes} (parameter lora_max_bytes)")


def build_adapter(name: str, path: Path, linears: Mapping[str, Linear], device: torch.device,
                  dtype: torch.dtype, recommended: dict[str, object] | None = None,
                  max_bytes: int | None = None) -> Adapter:
    """Read ``path`` (any known key scheme) fitted to ``linears``, stamped with the file it read.

    Judged from the header first: every target a dense or attention linear of the tower with
    factors of its shape, and the file and its factors in the model's dtype within ``max_bytes``;
    only then are the factors read. ConfigError naming the key."""
    from .lora import read_lora_file  # lora imports quant, which imports this package's layers

    itemsize = torch.empty(0, dtype=dtype).element_size()
    linears_shapes = {key: tuple(lin.weight.shape) for key, lin in linears.items()}
    pairs, header = read_lora_file(path, lambda h: judge_adapter(h, linears_shapes, itemsize, max_bytes), max_bytes)
    factors = {linears[pair.base + ".weight"]: Factors(
        pair.down.to(device=device, dtype=dtype).contiguous(), pair.up.to(device=device, dtype=dtype).contiguous(),
        pair.alpha / pair.rank if pair.alpha is not None else 1.0) for pair in pairs.values()}
    return Adapter(name, factors, dict(recommended or {}), header.stamp)


@dataclass(frozen=True)
class RowGroup:
    """Rows ``start:stop`` of the batch's hidden states take ``adapter`` at ``scale`` (stop None:
    every row, one request running alone)."""

    start: int
    stop: int | None
    adapter: Adapter
    scale: float


@contextmanager
def row_adapters(groups: tuple[RowGroup, ...]) -> Iterator[None]:
    """Every linear called inside the block applies ``groups`` (none: today's computation)."""
    token = ROW_ADAPTERS.set(groups)
    try:
        yield
    finally:
        ROW_ADAPTERS.reset(token)
