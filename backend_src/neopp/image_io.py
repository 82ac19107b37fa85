"""From the final estimate to delivered bytes: pixels, optional Lanczos resize, encoding."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from .errors import InputError
from .modes import OUTPUT_FORMATS, normalise_format

_PIL_FORMATS = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}


def to_pixels(x: torch.Tensor) -> np.ndarray:
    """[1, 3, H, W] normalised estimate -> uint8 [H, W, 3]."""
    img = (x[0].float() * 0.5 + 0.5).clamp(0.0, 1.0) * 255.0
    return img.round().to(torch.uint8).permute(1, 2, 0).contiguous().cpu().numpy()


def encode_image(pixels: np.ndarray, fmt: str = "jpeg", resize: tuple[int, int] | None = None,
                 quality: int = 95) -> bytes:
    fmt = normalise_format(fmt)
    if fmt not in OUTPUT_FORMATS:
        raise InputError(f"output_format: unknown format {fmt!r}; expected one of {OUTPUT_FORMATS}")
    image = Image.fromarray(pixels, mode="RGB")
    if resize is not None:
        height, width = (int(v) for v in resize)
        if height <= 0 or width <= 0:
            raise InputError(f"RESIZE: height and width must be positive, got {resize}")
        image = image.resize((width, height), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    options = {"quality": quality} if fmt in ("jpeg", "webp") else {}
    image.save(buf, format=_PIL_FORMATS[fmt], **options)
    return buf.getvalue()
