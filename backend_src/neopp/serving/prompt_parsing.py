"""The prompt encoder's request: ``PROMPT`` and optional ``NEGATIVE_PROMPT``, checked before any
tensor is computed. Pure Python (no Triton import), so the rules are testable without a server.

Prompts have their own bound (``neopp.contract.inputs.MAX_PROMPT_BYTES``), not the 64 bytes of
the generation models' enum-like strings: a prompt is free text, passed on as written (a U1
template holds it byte for byte; the checkpoint's tokenizer applies its own bounds).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..contract.inputs import (
    DEFAULT_THINK_TOKENS,
    EDIT_INPUT_SPECS,
    MAX_EDIT_IMAGE_BYTES,
    MAX_EDIT_IMAGES,
    MAX_PROMPT_BYTES,
    THINK_INPUT_SPECS,
)
from ..errors import SHOWN_CHARS, InputError, shown
from ..request import check_think_tokens

PROMPT_INPUTS = ("PROMPT", "NEGATIVE_PROMPT")
# what the prompt encoder takes (neopp_t2i passes them on)
ENCODER_INPUTS = (*PROMPT_INPUTS, *EDIT_INPUT_SPECS, *THINK_INPUT_SPECS)


@dataclass(frozen=True)
class PromptRequest:
    """The two prompts of one request; an empty negative prompt is the unconditional branch.
    ``think``: the tower reasons (at most ``think_max_tokens`` tokens) before the image."""

    prompt: str
    negative_prompt: str = ""
    think: bool = False
    think_max_tokens: int = DEFAULT_THINK_TOKENS
    images: tuple[bytes, ...] = ()  # the encoded input pictures of an edit, in order; () for text-to-image


def prompt_text(name: str, value: Any) -> str:
    """One prompt: a BYTES tensor of shape [1] holding UTF-8 text of at most MAX_PROMPT_BYTES."""
    arr = np.asarray(value)
    if arr.shape != (1,):
        raise InputError(f"{name}: shape must be [1] (one prompt), got {list(arr.shape)}")
    item = arr.reshape(-1)[0]
    if isinstance(item, str):
        item = item.encode("utf-8")
    if not isinstance(item, bytes):  # numpy's bytes_ included
        raise InputError(f"{name}: must be a BYTES (STRING) tensor, got {type(item).__name__}")
    if len(item) > MAX_PROMPT_BYTES:
        raise InputError(f"{name}: at most {MAX_PROMPT_BYTES} bytes, got {len(item)} ({shown(bytes(item))})")
    try:
        return bytes(item).decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{name}: must be UTF-8 text, got {shown(bytes(item))}") from None


def parse_prompts(inputs: Mapping[str, Any]) -> PromptRequest:
    """``inputs`` maps input names to numpy arrays; an absent optional input is missing."""
    unknown = sorted(set(inputs) - set(ENCODER_INPUTS))
    if unknown:
        name = unknown[0] if len(unknown[0]) <= SHOWN_CHARS else shown(unknown[0])
        raise InputError(f"{name}: unknown input; expected names from {list(ENCODER_INPUTS)}")
    if inputs.get("PROMPT") is None:
        raise InputError("PROMPT: required input is missing")
    negative = inputs.get("NEGATIVE_PROMPT")
    think = inputs.get("THINK") is not None and _flag("THINK", inputs["THINK"])
    cap = inputs.get("THINK_MAX_TOKENS")
    if cap is not None and not think:
        raise InputError("THINK_MAX_TOKENS: given without THINK set to true")
    images = () if inputs.get("IMAGES") is None else image_files(inputs["IMAGES"])
    return PromptRequest(prompt_text("PROMPT", inputs["PROMPT"]),
                         "" if negative is None else prompt_text("NEGATIVE_PROMPT", negative), think,
                         DEFAULT_THINK_TOKENS if cap is None else check_think_tokens(_count("THINK_MAX_TOKENS", cap)),
                         images)


def image_files(value: Any) -> tuple[bytes, ...]:
    """``IMAGES``: a BYTES tensor [N] of 1..MAX_EDIT_IMAGES encoded files, each non-empty and at
    most MAX_EDIT_IMAGE_BYTES (what they hold is checked when they are decoded)."""
    arr = np.asarray(value)
    if arr.ndim != 1 or not 1 <= arr.shape[0] <= MAX_EDIT_IMAGES:
        raise InputError(f"IMAGES: shape must be [N] with 1 <= N <= {MAX_EDIT_IMAGES} pictures, "
                         f"got {list(arr.shape)}")
    files = []
    for i, item in enumerate(arr):
        if not isinstance(item, bytes):  # numpy's bytes_ included
            raise InputError(f"IMAGES: must be a BYTES (STRING) tensor of encoded files, got {type(item).__name__}")
        if not 0 < len(item) <= MAX_EDIT_IMAGE_BYTES:
            raise InputError(f"IMAGES: picture {i + 1} has {len(item)} bytes; each must have 1 to "
                             f"{MAX_EDIT_IMAGE_BYTES} bytes")
        files.append(bytes(item))
    return tuple(files)


def _flag(name: str, value: Any) -> bool:
    arr = np.asarray(value)
    if arr.shape != (1,) or arr.dtype != np.bool_:
        raise InputError(f"{name}: must be a BOOL tensor of shape [1], got {arr.dtype} {list(arr.shape)}")
    return bool(arr[0])


def _count(name: str, value: Any) -> int:
    arr = np.asarray(value)
    if arr.shape != (1,) or arr.dtype != np.int64:
        raise InputError(f"{name}: must be an INT64 tensor of shape [1], got {arr.dtype} {list(arr.shape)}")
    return int(arr[0])
