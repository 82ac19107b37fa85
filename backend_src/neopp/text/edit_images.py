"""An edit's input pictures, from the client's encoded files to the pixels the vision embedding reads.

The official editing path, rule for rule:

* each file is decoded (PNG, JPEG or WebP only); an RGBA picture is laid on white, any other
  mode converted to RGB;
* it is resized (Pillow's default filter, bicubic for RGB) to sides that are multiples of 32
  (one image token), rounded to the nearest multiple, then scaled into
  ``[512*512, min(2048*2048, 4096*4096 / N)]`` pixels for N pictures;
* its pixels are normalised with the ImageNet mean and standard deviation (not the generation
  tower's 0.5 / 0.5).

A file is checked before its pixels are decoded: its format from its header, and its decoded
size against ``MAX_EDIT_IMAGE_PIXELS``, so a small file that would decode to a huge picture is
refused without the work. Refusals name ``IMAGES`` and the picture's place, never its bytes.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from ..contract.inputs import EDIT_IMAGE_FORMATS, MAX_EDIT_IMAGE_PIXELS
from ..errors import InputError

TOKEN_SIDE = 32  # pixels per image token side: 16-pixel patches merged 2 x 2
MIN_PIXELS = 512 * 512
MAX_PIXELS = 2048 * 2048
MAX_TOTAL_PIXELS = 4096 * 4096  # shared by the pictures of one request
MAX_ASPECT = 200
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Picture:
    """One input picture as the vision embedding reads it."""

    pixels: torch.Tensor  # [1, 3, H, W] float32, normalised

    @property
    def rows(self) -> int:
        return self.pixels.shape[2] // TOKEN_SIDE

    @property
    def cols(self) -> int:
        return self.pixels.shape[3] // TOKEN_SIDE

    @property
    def num_tokens(self) -> int:
        return self.rows * self.cols


def read_pictures(files: tuple[bytes, ...]) -> tuple[Picture, ...]:
    """Every file of ``IMAGES``, decoded, resized and normalised."""
    max_pixels = min(MAX_PIXELS, MAX_TOTAL_PIXELS // len(files))
    return tuple(_prepare(_decode(data, i + 1), i + 1, max_pixels) for i, data in enumerate(files))


def _decode(data: bytes, place: int) -> Image.Image:
    name = f"IMAGES: picture {place}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(EDIT_IMAGE_FORMATS))
            width, height = image.size
            if width * height > MAX_EDIT_IMAGE_PIXELS:
                raise InputError(f"{name} is {width}x{height} pixels; at most {MAX_EDIT_IMAGE_PIXELS} pixels")
            image.load()
    except InputError:
        raise
    except Exception:  # noqa: BLE001 - whatever Pillow raises on a bad file, the client hears one rule
        raise InputError(f"{name} does not decode as {', '.join(EDIT_IMAGE_FORMATS)}") from None
    return image


def _prepare(image: Image.Image, place: int, max_pixels: int) -> Picture:
    if image.mode == "RGBA":
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.split()[3])
        image = background
    else:
        image = image.convert("RGB")
    height, width = fitted_size(image.height, image.width, max_pixels, place)
    image = image.resize((width, height), Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).float().div(255)
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return Picture(((pixels - mean) / std)[None])


def fitted_size(height: int, width: int, max_pixels: int, place: int = 1) -> tuple[int, int]:
    """The resized (height, width): multiples of 32, nearest first, then scaled into the pixel range."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise InputError(f"IMAGES: picture {place} is {width}x{height}; its sides may differ at most "
                         f"{MAX_ASPECT} times")
    f = TOKEN_SIDE
    h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < MIN_PIXELS:
        beta = math.sqrt(MIN_PIXELS / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return h, w
