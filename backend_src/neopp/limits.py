"""Request bounds, checked before any allocation that depends on them."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .errors import InputError, shown


@dataclass(frozen=True)
class Limits:
    """Defaults suit a 1-2K image service (the shipped configs' values); every field is a
    `config.pbtxt` parameter."""

    max_side: int = 2048
    max_pixels: int = 2048 * 2048
    max_prefix_tokens: int = 32768
    max_steps: int = 200
    max_index_offset: int = 1_000_000
    max_request_bytes: int = 256 << 20  # two real 8B prefixes of 300 tokens are 88.5 MB

    @classmethod
    def from_params(cls, params: dict[str, str]) -> Limits:
        """Pick `max_*` keys out of string parameters (Triton's `parameters` map)."""
        values = {}
        for f in fields(cls):
            if f.name in params and str(params[f.name]).strip():
                values[f.name] = int(params[f.name])
        return cls(**values)


# Fixed bounds of sampling values (not per model): beyond them the arithmetic itself breaks
# (a shift near 0 divides by a rounded 0, a huge guidance scale overflows to inf), far outside
# any useful setting. Strings are table words, so a few dozen bytes is plenty.
CFG_SCALE_MAX_ABS = 100.0
TIMESTEP_SHIFT_RANGE = (1e-3, 1e3)
MAX_TEXT_BYTES = 64


def text_value(name: str, item: Any) -> str:
    """One client string, bounded and decoded; a refusal names the input and shows only a prefix.

    Here, not with the request parsing, so the session model reads its strings without torch.
    """
    if isinstance(item, (bytes, str)) and len(item) > MAX_TEXT_BYTES:  # numpy's bytes_/str_ included
        raise InputError(f"{name}: at most {MAX_TEXT_BYTES} bytes, got {len(item)} ({shown(item)})")
    if isinstance(item, bytes):
        try:
            return bytes(item).decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            raise InputError(f"{name}: must be UTF-8 text, got {shown(bytes(item))}") from exc
    if isinstance(item, str):
        return item.strip()
    raise InputError(f"{name}: must be a STRING (BYTES) tensor, got {type(item).__name__}")
