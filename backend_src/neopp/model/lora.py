"""LoRA files (the mode file's `lora_configs`) merged into the checkpoint's weights at load.

Merging once at load means every step runs the plain (or FP8) weights at full speed and every
serving path, the parallel workers included, sees the merged model. Three naming schemes are
read: `<base>.lora_up.weight` / `<base>.lora_down.weight` (+ optional `<base>.alpha`),
`<base>.lora_B.weight` / `<base>.lora_A.weight`, and the PEFT form
`<base>.lora_B.default.weight` / `<base>.lora_A.default.weight`; a `diffusion_model.` prefix on
`<base>` is dropped. The target is
`<base>.weight`; `W += strength * (alpha / rank) * up @ down` (factor 1 without alpha).
A key that matches nothing, or a shape that does not fit, is an error naming the key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import ConfigError
from .checkpoint import FP8_DTYPE
from .quant import dequantize_fp8

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


def split_key(key: str) -> tuple[str, str, str]:
    """(base, role, scheme) of a LoRA key; ConfigError for a key of no known scheme."""
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if key.endswith(suffix) and len(key) > len(suffix):
            role, scheme = SUFFIXES[suffix]
            return key[: -len(suffix)].removeprefix(OFFICIAL_PREFIX), role, scheme
    raise ConfigError(f"key '{key}' is not a LoRA key of any known naming scheme "
                      f"(expected <base> + one of {sorted(SUFFIXES)})")


def read_lora_pairs(path: str | Path) -> dict[str, LoraPair]:
    """Group a file's tensors by target; every base needs exactly one up and one down."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"LoRA file {path} does not exist")
    pairs: dict[str, LoraPair] = {}
    schemes: dict[str, str] = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                try:
                    base, role, scheme = split_key(key)
                except ConfigError as exc:
                    raise ConfigError(f"LoRA {path}: {exc}") from None
                pair = pairs.setdefault(base, LoraPair(base))
                if scheme != "any" and schemes.setdefault(base, scheme) != scheme:
                    raise ConfigError(f"LoRA {path}: key '{key}' mixes naming schemes for '{base}'")
                tensor = handle.get_tensor(key)
                if role == "alpha":
                    if tensor.numel() != 1:
                        raise ConfigError(f"LoRA {path}: key '{key}' must be a scalar, has shape {tuple(tensor.shape)}")
                    pair.alpha = float(tensor.float().item())
                elif role == "up":
                    pair.up, pair.up_key = tensor, key
                else:
                    pair.down, pair.down_key = tensor, key
    except SafetensorError as exc:
        raise ConfigError(f"LoRA {path}: not a readable safetensors file ({exc})") from exc
    for base, pair in pairs.items():
        if pair.up is None or pair.down is None:
            have = pair.up_key or pair.down_key or f"{base}.alpha"
            missing = "up (lora_up / lora_B)" if pair.up is None else "down (lora_down / lora_A)"
            raise ConfigError(f"LoRA {path}: key '{have}' has no matching {missing} matrix")
    return pairs


def check_pair(pair: LoraPair, tensors: Mapping[str, torch.Tensor], path: Path) -> str:
    """The target weight's key, after checking that it exists and every shape fits."""
    target = pair.base + ".weight"
    if target not in tensors:
        raise ConfigError(f"LoRA {path}: key '{pair.up_key}' matches no weight of the generation tower "
                          f"(no '{target}' in the checkpoint)")
    weight = tensors[target]
    up, down = pair.up, pair.down
    if weight.dim() != 2:
        raise ConfigError(f"LoRA {path}: key '{pair.up_key}' targets '{target}' of shape {tuple(weight.shape)}; "
                          "only 2-D linear weights take a LoRA")
    if up.dim() != 2 or down.dim() != 2 or up.shape[1] != down.shape[0]:
        raise ConfigError(f"LoRA {path}: keys '{pair.up_key}' {tuple(up.shape)} and '{pair.down_key}' "
                          f"{tuple(down.shape)} are not [out, rank] and [rank, in] factors of one rank")
    if up.shape[0] != weight.shape[0]:
        raise ConfigError(f"LoRA {path}: key '{pair.up_key}' has {up.shape[0]} rows; '{target}' "
                          f"{tuple(weight.shape)} needs {weight.shape[0]}")
    if down.shape[1] != weight.shape[1]:
        raise ConfigError(f"LoRA {path}: key '{pair.down_key}' has {down.shape[1]} columns; '{target}' "
                          f"{tuple(weight.shape)} needs {weight.shape[1]}")
    return target


def merge_lora_(tensors: dict[str, torch.Tensor], path: str | Path, strength: float = 1.0) -> list[str]:
    """Merge one file into `tensors` in place; returns the merged weight keys.

    Everything is checked before anything is changed. A weight stored as FP8 with a scale is
    expanded to float32 and its scale dropped (the FP8 mode requantises the merged result);
    other weights keep their dtype.
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
