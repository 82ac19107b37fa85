"""Request bounds, checked before any allocation that depends on them."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Limits:
    """Defaults suit a 1-2K image service; every field is a `config.pbtxt` parameter."""

    max_side: int = 4096
    max_pixels: int = 4096 * 4096
    max_prefix_tokens: int = 32768
    max_steps: int = 200
    max_index_offset: int = 1_000_000
    max_request_bytes: int = 1 << 30

    @classmethod
    def from_params(cls, params: dict[str, str]) -> "Limits":
        """Pick `max_*` keys out of string parameters (Triton's `parameters` map)."""
        values = {}
        for f in fields(cls):
            if f.name in params and str(params[f.name]).strip():
                values[f.name] = int(params[f.name])
        return cls(**values)
