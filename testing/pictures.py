"""Comparing pictures drawn on different paths.

A served picture's file records the model and mode that drew it (and the in-process runners
write no record), so two paths that draw the same pixels write different bytes. Tests across
paths compare the decoded pixels, exactly (PNG is lossless); tests along one path keep comparing
bytes.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def decoded(data: bytes) -> np.ndarray:
    """A picture file's pixels, as RGB."""
    with Image.open(io.BytesIO(bytes(data))) as image:
        return np.asarray(image.convert("RGB"))


def same_pixels(*pictures: bytes) -> bool:
    """Whether every file holds exactly the first one's pixels."""
    first = decoded(pictures[0])
    return all(np.array_equal(first, decoded(p)) for p in pictures[1:])
