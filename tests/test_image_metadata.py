"""Every delivered picture is marked as made by a model, in each format, read back with Pillow's
own readers; the marking changes no pixel and is the same in every file."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from neopp.image_io import encode_image
from neopp.image_metadata import DIGITAL_SOURCE_TYPE

PIXELS = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_each_format_carries_the_digital_source_type(fmt):
    data = encode_image(PIXELS, fmt)
    image = Image.open(io.BytesIO(data))
    xmp = image.info["xmp"]
    xmp = xmp.decode() if isinstance(xmp, bytes) else xmp
    assert f'Iptc4xmpExt:DigitalSourceType="{DIGITAL_SOURCE_TYPE}"' in xmp
    assert encode_image(PIXELS, fmt) == data  # the same bytes each time


def test_the_marking_changes_no_pixel():
    plain = io.BytesIO()
    Image.fromarray(PIXELS).save(plain, "PNG")
    marked = Image.open(io.BytesIO(encode_image(PIXELS, "png")))
    assert np.array_equal(np.asarray(marked.convert("RGB")), PIXELS)
    assert np.array_equal(np.asarray(Image.open(plain).convert("RGB")), np.asarray(marked.convert("RGB")))
