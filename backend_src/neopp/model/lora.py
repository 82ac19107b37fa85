"""LoRA files (the mode file's `lora_configs`) merged into the checkpoint's weights at load.

Merging once at load means every step runs the plain (or FP8) weights at full speed and every
serving path, the parallel workers included, sees the merged model. Three naming schemes are
read: `<base>.lora_up.weight` / `<base>.lora_down.weight` (+ optional `<base>.alpha`),
`<base>.lora_B.weight` / `<base>.lora_A.weight`, and the PEFT form
`<base>.lora_B.default.weight` / `<base>.lora_A.default.weight`; a `diffusion_model.` prefix on
`<base>` is dropped. The target is
`<base>.weight`; `W += strength * (alpha / rank) * up @ down` (factor 1 without alpha).
A key that matches nothing, or a shape that does not fit, is an error naming the key.
Every LoRA file, merged or applied per request, is read by ``read_lora_file``: its header judged
before a factor byte is read (``safetensors_header``), then its tensors read once into memory.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from .checkpoint import FP8_DTYPE
from .gguf_checkpoint import GGUFWeight
from .quant import dequantize_fp8
from .safetensors_header import (
    FileChanged,
    Header,
    Stamp,
    TensorEntry,
    check_size,
    key_shown,
    open_regular,
    read_header,
    read_tensor,
    stamp_of,
)

# suffix -> (role, scheme); roles: up (B, [out, r]), down (A, [r, in]), alpha (scalar)
SUFFIXES: dict[str, tuple[str, str]] = {
    ".lora_up.weight": ("up", "up_down"), ".lora_down.weight": ("down", "up_down"),
    ".lora_B.default.weight": ("up", "peft"), ".lora_A.default.weight": ("down", "peft"),
    ".lora_B.weight": ("up", "B_A"), ".lora_A.weight": ("down", "B_A"),
    ".alpha": ("alpha", "any"),
}
SCHEMES = ("up_down", "B_A", "peft")
# The official files may name targets under the diffusion model's own prefix; targets are the tower's keys.
OFFICIAL_PREFIX = "diffusion_model."
SCHEME_SUFFIX = {"up_down": (".lora_up.weight", ".lora_down.weight"),
                  "B_A": (".lora_B.weight", ".lora_A.weight"),
                  "peft": (".lora_B.default.weight", ".lora_A.default.weight")}
MAX_ALPHA_ABS = 65536.0  # far beyond any trained alpha (at most a few times the rank)


@dataclass
class LoraPair:
    """One target weight's factors, with the keys they came from (for error messages)."""

    base: str
    up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    alpha: float | None = None
    up_key: str = ""
    down_key: str = ""

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    def delta(self, strength: float) -> torch.Tensor:
        """`strength * (alpha / rank) * up @ down` in float32."""
        factor = strength * (self.alpha / self.rank if self.alpha is not None else 1.0)
        return factor * (self.up.float() @ self.down.float())


@dataclass(frozen=True)
class PairPlan:
    """One target's factors as the header describes them, before a byte of them is read."""

    base: str  # the weight the pair adds to
    up: TensorEntry  # (out, rank)
    down: TensorEntry  # (rank, in)
    alpha: TensorEntry | None = None  # a scalar; None: scale 1

    @property
    def numel(self) -> int:
        return self.up.numel + self.down.numel


def split_key(key: str) -> tuple[str, str, str]:
    """(base, role, scheme) of a LoRA key; ConfigError for a key of no known scheme."""
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if key.endswith(suffix) and len(key) > len(suffix):
            role, scheme = SUFFIXES[suffix]
            return key[: -len(suffix)].removeprefix(OFFICIAL_PREFIX), role, scheme
    raise ConfigError(f"key {key_shown(key)} is not a LoRA key of any known naming scheme "
                      f"(expected <base> + one of {sorted(SUFFIXES)})")


def plan_pairs(header: Header) -> dict[str, PairPlan]:
    """Group a header's tensors by target: one up and one down of one rank (at least 1), an
    optional scalar alpha, one naming scheme per target."""
    roles: dict[str, dict[str, TensorEntry]] = {}
    schemes: dict[str, str] = {}
    for key, entry in header.entries.items():
        base, role, scheme = split_key(key)
        if scheme != "any" and schemes.setdefault(base, scheme) != scheme:
            raise ConfigError(f"key {key_shown(key)} mixes naming schemes for its target")
        held = roles.setdefault(base, {})
        if role in held:
            raise ConfigError(f"keys {key_shown(held[role].key)} and {key_shown(key)} give one target two {role}s")
        held[role] = entry
    if not roles:
        raise ConfigError("holds no LoRA factors")
    return {base: _plan(base, held) for base, held in roles.items()}


def _plan(base: str, held: dict[str, TensorEntry]) -> PairPlan:
    up, down, alpha = held.get("up"), held.get("down"), held.get("alpha")
    if up is None or down is None:
        have = (up or down or alpha).key
        missing = "up (lora_up / lora_B)" if up is None else "down (lora_down / lora_A)"
        raise ConfigError(f"key {key_shown(have)} has no matching {missing} matrix")
    if len(up.shape) != 2 or len(down.shape) != 2 or up.shape[1] != down.shape[0]:
        raise ConfigError(f"keys {key_shown(up.key)} {list(up.shape)} and {key_shown(down.key)} {list(down.shape)} "
                          "are not [out, rank] and [rank, in] factors of one rank")
    if down.shape[0] == 0:
        raise ConfigError(f"key {key_shown(down.key)} has rank 0; a LoRA's rank is at least 1")
    if alpha is not None and alpha.numel != 1:
        raise ConfigError(f"key {key_shown(alpha.key)} must be a scalar, has shape {list(alpha.shape)}")
    return PairPlan(base, up, down, alpha)


def check_fit(plan: PairPlan, weights: Mapping[str, Any]) -> str:
    """The target weight's key, after checking that the tower has it and the factors fit its
    shape; ``weights`` holds tensors (shape-only ones will do) or shapes."""
    target = plan.base + ".weight"
    if target not in weights:
        raise ConfigError(f"key {key_shown(plan.up.key)} matches no weight of the generation tower")
    shape = tuple(getattr(weights[target], "shape", weights[target]))
    if len(shape) != 2:
        raise ConfigError(f"key {key_shown(plan.up.key)} targets a weight of shape {list(shape)}; "
                          "only 2-D linear weights take a LoRA")
    if plan.up.shape[0] != shape[0]:
        raise ConfigError(f"key {key_shown(plan.up.key)} has {plan.up.shape[0]} rows; its target {list(shape)} "
                          f"needs {shape[0]}")
    if plan.down.shape[1] != shape[1]:
        raise ConfigError(f"key {key_shown(plan.down.key)} has {plan.down.shape[1]} columns; its target "
                          f"{list(shape)} needs {shape[1]}")
    return target


def alpha_value(fd: int, header: Header, entry: TensorEntry) -> float:
    """A pair's alpha, finite and within MAX_ALPHA_ABS (its rank then divides it: rank is at least 1)."""
    value = float(read_tensor(fd, header, entry).double().reshape(-1)[0])
    if not math.isfinite(value) or abs(value) > MAX_ALPHA_ABS:
        raise ConfigError(f"key {key_shown(entry.key)} holds alpha {value!r}; it must be a finite number within "
                          f"-{MAX_ALPHA_ABS:g}..{MAX_ALPHA_ABS:g}")
    return value


@dataclass(frozen=True)
class LoraHeader:
    """What a LoRA file's header says, judged: its pairs, their alphas, its metadata, its stamp."""

    plans: dict[str, PairPlan]
    alphas: dict[str, float]
    metadata: dict[str, str]
    stamp: Stamp


def _judged(fd: int, header: Header) -> LoraHeader:
    plans = plan_pairs(header)
    alphas = {b: alpha_value(fd, header, p.alpha) for b, p in plans.items() if p.alpha is not None}
    return LoraHeader(plans, alphas, header.metadata, stamp_of(os.fstat(fd)))


def judge_lora_file(path: Path) -> LoraHeader:
    """A LoRA file judged from its header and its alphas alone; no factor byte is read."""
    fd = open_regular(path)
    try:
        return _judged(fd, read_header(fd, os.fstat(fd).st_size))
    finally:
        os.close(fd)


def read_lora_file(path: Path, judge: Callable[[LoraHeader], None] = lambda _: None,
                   max_bytes: int | None = None) -> tuple[dict[str, LoraPair], LoraHeader]:
    """A LoRA file's pairs: the header judged (and by ``judge``) before a factor byte is read, then
    every tensor read once into memory and checked finite; a file changed meanwhile is refused."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        check_size(size, max_bytes)
        header = read_header(fd, size)
        judged = _judged(fd, header)
        judge(judged)
        pairs = {}
        for base, plan in judged.plans.items():
            up, down = read_tensor(fd, header, plan.up), read_tensor(fd, header, plan.down)
            for tensor, key in ((up, plan.up.key), (down, plan.down.key)):
                if not torch.isfinite(tensor).all():
                    raise ConfigError(f"key {key_shown(key)} holds a NaN or an infinity")
            pairs[base] = LoraPair(base, up, down, judged.alphas.get(base), plan.up.key, plan.down.key)
        if stamp_of(os.fstat(fd)) != judged.stamp:
            raise FileChanged("its file changed while it was read")
    finally:
        os.close(fd)
    return pairs, judged


def read_lora_pairs(path: str | Path) -> dict[str, LoraPair]:
    """A mode file's LoRA (the operator's file, named by its path in messages), every pair checked."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"LoRA file {path} does not exist")
    try:
        return read_lora_file(path.resolve())[0]
    except ConfigError as exc:
        raise ConfigError(f"LoRA {path}: {exc}") from None


def check_pair(pair: LoraPair, tensors: Mapping[str, Any], path: Path) -> str:
    """The target weight's key of a read pair, after checking that it exists and every shape fits."""
    up = TensorEntry(pair.up_key, "F32", tuple(pair.up.shape), 0, 0)
    down = TensorEntry(pair.down_key, "F32", tuple(pair.down.shape), 0, 0)
    try:
        return check_fit(PairPlan(pair.base, up, down), tensors)
    except ConfigError as exc:
        raise ConfigError(f"LoRA {path}: {exc}") from None


def merge_lora_(tensors: dict[str, torch.Tensor], path: str | Path, strength: float = 1.0) -> list[str]:
    """Merge one file into `tensors` in place; returns the merged weight keys.

    Everything is checked before anything is changed. A weight stored as FP8 with a scale is
    expanded to float32 and its scale dropped (the FP8 mode requantises the merged result), and
    a GGUF block-quantized weight is held in float32 once merged; other weights keep their dtype.
    """
    path = Path(path)
    pairs = read_lora_pairs(path)
    targets = [(check_pair(pair, tensors, path), pair) for pair in pairs.values()]
    for target, pair in targets:
        weight = tensors[target]
        scale = tensors.get(target + "_scale")
        if scale is not None:
            merged = dequantize_fp8(weight, scale) + pair.delta(strength)
            del tensors[target + "_scale"]
        elif isinstance(weight, GGUFWeight):  # a merged block-quantized weight is held in float32
            merged = weight.dequantize() + pair.delta(strength)
        else:
            out_dtype = torch.float32 if weight.dtype == FP8_DTYPE else weight.dtype
            merged = (weight.float() + pair.delta(strength)).to(out_dtype)
        tensors[target] = merged
    return [t for t, _ in targets]


def check_loras(weights: Mapping[str, torch.Tensor], lora_configs: Iterable[Mapping]) -> None:
    """Check that every LoRA of a mode fits ``weights`` without changing anything.

    ``weights`` may be shape-only tensors (checkpoint.generation_shapes), so a LoRA made for
    another checkpoint is refused before the weights are loaded; the error names the file and
    the first key that does not fit.
    """
    for entry in lora_configs:
        if "path" not in entry:
            raise ConfigError("lora_configs: every entry needs a 'path'")
        path = Path(entry["path"])
        for pair in read_lora_pairs(path).values():
            check_pair(pair, weights, path)


def apply_loras_(tensors: dict[str, torch.Tensor], lora_configs: Iterable[Mapping]) -> list[str]:
    """Merge a mode's `lora_configs` ([{path, strength}]) in order."""
    merged: list[str] = []
    for entry in lora_configs:
        if "path" not in entry:
            raise ConfigError("lora_configs: every entry needs a 'path'")
        try:
            strength = float(entry.get("strength", 1.0))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"lora_configs: strength {entry.get('strength')!r} of {entry['path']} "
                              "is not a number") from exc
        merged += merge_lora_(tensors, entry["path"], strength)
    return merged


# ---- tiny LoRA files for tests and `make serve` -------------------------------------------
