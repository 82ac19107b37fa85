"""From pixels to delivered bytes: optional Lanczos resize, encoding with the file's marking
(no torch: a forwarding stub encodes its own images)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from .errors import InputError
from .image_metadata import save_options
from .modes import OUTPUT_FORMATS, normalise_format

PIL_FORMATS = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}


def encode_image(pixels: np.ndarray, fmt: str = "jpeg", resize: tuple[int, int] | None = None,
                 quality: int = 95, record: str | None = None) -> bytes:
    """The delivered file, marked as made by a model, with the request's record when given
    (:mod:`neopp.image_metadata`)."""
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
    image.save(buf, format=PIL_FORMATS[fmt], **options, **save_options(PIL_FORMATS[fmt], record))
    return buf.getvalue()
