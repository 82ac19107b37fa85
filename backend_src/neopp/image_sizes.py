"""The image sizes a model was trained at: declared by its checkpoint, narrowed by a mode file.

A checkpoint (``config.json``) or a mode file may declare ``image_sizes`` (a list of
``[height, width]``) and/or ``image_size_range`` (``[min_side, max_side]``: every size whose two
sides lie in it, multiples of the token size). Outside them a flow model draws noise, not a worse
picture, so the server refuses such sizes unless the operator allows untrained sizes. Nothing
declared: every size the limits allow is served, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

MAX_LISTED = 64  # a declared list is a handful of training resolutions, never a grid of thousands

Size = tuple[int, int]  # (height, width)


def _side(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 1 << 16


MAX_OFFERED = 64  # sizes a range offers one by one; past it, its squares


@dataclass(frozen=True)
class TrainedSizes:
    """Sizes in ``sizes`` (when listed) and with both sides in ``side_range`` (when given)."""

    sizes: tuple[Size, ...] = ()
    side_range: tuple[int, int] | None = None
    multiple: int = 32

    @staticmethod
    def from_raw(raw: dict[str, Any], where: str, multiple: int = 32) -> TrainedSizes:
        """``image_sizes`` / ``image_size_range`` of a checkpoint config or mode file, checked."""
        listed, side_range = raw.get("image_sizes"), raw.get("image_size_range")
        sizes: tuple[Size, ...] = ()
        if listed is not None:
            if not (isinstance(listed, list) and 0 < len(listed) <= MAX_LISTED and all(
                    isinstance(s, list) and len(s) == 2 and all(_side(v) and v % multiple == 0 for v in s)
                    for s in listed)):
                raise ConfigError(f"{where}: image_sizes must be a list of 1..{MAX_LISTED} [height, width] pairs, "
                                  f"positive multiples of {multiple}, got {str(listed)[:120]}")
            sizes = tuple((int(h), int(w)) for h, w in listed)
        bounds = None
        if side_range is not None:
            if not (isinstance(side_range, list) and len(side_range) == 2 and all(_side(v) for v in side_range)
                    and side_range[0] <= side_range[1]):
                raise ConfigError(f"{where}: image_size_range must be [min_side, max_side], positive and in order, "
                                  f"got {str(side_range)[:120]}")
            bounds = (int(side_range[0]), int(side_range[1]))
        return TrainedSizes(sizes, bounds, multiple)

    @property
    def declared(self) -> bool:
        return bool(self.sizes) or self.side_range is not None

    def allows(self, height: int, width: int) -> bool:
        if self.sizes and (height, width) not in self.sizes:
            return False
        if self.side_range is not None:
            low, high = self.side_range
            return low <= height <= high and low <= width <= high and height % self.multiple == 0 \
                and width % self.multiple == 0
        return True

    def narrowed(self, other: TrainedSizes) -> TrainedSizes:
        """What both allow (a mode file narrows its checkpoint's sizes, never widens them)."""
        sizes = tuple(s for s in self.sizes if not other.sizes or s in other.sizes) if self.sizes else other.sizes
        if self.side_range is None or other.side_range is None:
            bounds = self.side_range or other.side_range
        else:
            bounds = (max(self.side_range[0], other.side_range[0]), min(self.side_range[1], other.side_range[1]))
        return TrainedSizes(sizes, bounds, self.multiple)

    def listed(self) -> list[Size]:
        """The sizes to offer: the listed ones in range, else every size of the range (non-square
        ones too) while they are at most MAX_OFFERED, else its square sizes."""
        if self.sizes:
            return [s for s in self.sizes if self.allows(*s)]
        if self.side_range is None:
            return []
        low, high = self.side_range
        first = -(-low // self.multiple) * self.multiple
        sides = list(range(first, high + 1, self.multiple))
        if len(sides) ** 2 <= MAX_OFFERED:
            return [(h, w) for h in sides for w in sides]
        return [(side, side) for side in sides]

    def describe(self) -> str:
        """The rule in words, for a refusal: the range and/or the listed sizes."""
        parts = []
        if self.side_range is not None:
            parts.append(f"sides of {self.side_range[0]} to {self.side_range[1]} pixels, multiples of {self.multiple}")
        if self.sizes:
            shown = ", ".join(f"[{h}, {w}]" for h, w in self.listed()[:12])
            parts.append(f"[height, width] one of {shown}" + (" ..." if len(self.listed()) > 12 else ""))
        return " and ".join(parts)
