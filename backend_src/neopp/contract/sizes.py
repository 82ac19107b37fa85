"""An image size and its two spellings: ``HxW`` (the models' inputs and parameters, height
first as in ``SIZE``) and OpenAI's ``WxH`` (``/v1``'s ``size``, the CLI's ``--size``)."""

from __future__ import annotations

import re

MAX_SIDE_DIGITS = 5
SIZE_TEXT = re.compile(rf"^([0-9]{{1,{MAX_SIDE_DIGITS}}})x([0-9]{{1,{MAX_SIDE_DIGITS}}})$")

Size = tuple[int, int]  # (height, width)


def _two_sides(text: str) -> tuple[int, int]:
    match = SIZE_TEXT.match(text.strip().lower())
    if match is None:
        raise ValueError(f"{text!r} is not two sides of at most {MAX_SIDE_DIGITS} digits joined by 'x'")
    return int(match.group(1)), int(match.group(2))


def height_width(text: str) -> Size:
    """``HxW`` as (height, width); ValueError names the spelling."""
    return _two_sides(text)


def openai_size(text: str) -> Size:
    """OpenAI's ``WxH`` as (height, width); ValueError names the spelling."""
    width, height = _two_sides(text)
    return height, width


def openai_text(size: Size) -> str:
    """(height, width) as OpenAI's ``WxH``."""
    return f"{size[1]}x{size[0]}"


def is_openai_size(text: str) -> bool:
    """Whether ``text`` is spelt ``WxH`` (the range is the model's to judge)."""
    return SIZE_TEXT.match(text) is not None
