"""The streaming models' inputs: the contract table plus the preview and JSON-transport rows.

A streaming model takes every input of its plain twin (``INPUT_SPECS``) and adds:

* ``PREVIEW_EVERY`` / ``PREVIEW_SIZE``: how often and how large a progress response carries a
  JPEG of the current clean-image prediction;
* ``COND_KV_B64`` / ``UNCOND_KV_B64`` / ``IMAGE_KV_B64``: a KV prefix as base64 text of its raw
  bfloat16 bytes, because Triton's ``generate_stream`` endpoint (HTTP/SSE) builds tensors from JSON values and
  JSON has no BF16. ``COND_KV`` is therefore optional here: a request gives one of the two;
* ``BASE64_OUTPUT``: 1 makes ``IMAGE`` and ``PREVIEW`` base64 text, which JSON (SSE) can carry.

Everything is checked here before the plain parser runs on the result, so every rule of the
plain models applies unchanged and every failure names its input.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InputError
from ..limits import Limits
from ..modes import SamplingParams

if TYPE_CHECKING:  # only the engine's stub decodes a prefix
    import torch

from ..contract.inputs import B64_INPUTS, STREAM_INPUT_SPECS, STREAM_ONLY
from .request_parsing import ParsedRequest, _check_request_bytes, parse_request

DEFAULT_PREVIEW_SIDE = 256  # the longer side of a default preview (never larger than the image)
PREVIEW_MAX_SIDE = 1024  # and never over the model's max_side


@dataclass(frozen=True)
class StreamOptions:
    """What a streaming request asks beyond the plain request."""

    preview_every: int = 0  # 0: no previews
    preview_size: tuple[int, int] | None = None  # [height, width]; None: default_preview_size
    base64_output: bool = False


def _ints(name: str, value: Any, count: int) -> list[int]:
    arr = np.asarray(value)
    if arr.dtype != np.int64:
        raise InputError(f"{name}: datatype must be INT64, got {arr.dtype}")
    if arr.shape != (count,):
        raise InputError(f"{name}: shape must be [{count}], got {list(arr.shape)}")
    return [int(v) for v in arr]


def _preview_every(value: Any, limits: Limits) -> int:
    every = _ints("PREVIEW_EVERY", value, 1)[0]
    if not 0 <= every <= limits.max_steps:
        raise InputError(f"PREVIEW_EVERY: must be 0 (no previews) .. {limits.max_steps} (max_steps), got {every}")
    return every


def _preview_size(value: Any, limits: Limits) -> tuple[int, int]:
    height, width = _ints("PREVIEW_SIZE", value, 2)
    most = min(PREVIEW_MAX_SIDE, limits.max_side)
    if not (1 <= height <= most and 1 <= width <= most):
        raise InputError(f"PREVIEW_SIZE: [height, width] must each be 1..{most}, got [{height}, {width}]")
    return height, width


def _flag(name: str, value: Any) -> bool:
    flag = _ints(name, value, 1)[0]
    if flag not in (0, 1):
        raise InputError(f"{name}: must be 0 or 1, got {flag}")
    return bool(flag)


def decode_kv_b64(name: str, value: Any, kv_dims: tuple[int, int, int],
                  max_tokens: int | None = None) -> torch.Tensor:
    """Base64 of raw little-endian bfloat16 bytes -> ``[layers, 2, seq, kv_heads, head_dim]``.

    Only the sequence length is free; the other dims are the checkpoint's, so the byte count
    must be a whole number of token rows. The caller has bounded the text's size already; the
    token count follows from the text's length, so ``max_tokens`` is checked before decoding
    (a prefix over the limit is never materialised, and the error names the input sent).
    """
    arr = np.asarray(value, dtype=np.object_)
    if arr.shape != (1,):
        raise InputError(f"{name}: shape must be [1] (one base64 string), got {list(arr.shape)}")
    text = arr[0]
    if not isinstance(text, (bytes, str)):
        raise InputError(f"{name}: must be a STRING (BYTES) tensor holding base64 text")
    layers, kv_heads, head_dim = kv_dims
    row = layers * 2 * kv_heads * head_dim * 2  # bytes of one token over every layer, K and V
    pad = min(2, len(text) - len(text.rstrip(b"=" if isinstance(text, bytes) else "=")))
    fewest = (len(text) // 4 * 3 - pad) // row  # exact for valid base64, a lower bound otherwise
    if max_tokens is not None and fewest > max_tokens:
        raise InputError(f"{name}: {len(text)} characters of base64 hold at least {fewest} tokens of {row} bytes, "
                         f"over the limit max_prefix_tokens={max_tokens}")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InputError(f"{name}: must be base64 text (standard alphabet, padded): {exc}") from None
    if not raw or len(raw) % row:
        raise InputError(f"{name}: {len(raw)} decoded bytes are not a positive whole number of tokens of "
                         f"{row} bytes (bf16 [{layers}, 2, seq, {kv_heads}, {head_dim}])")
    seq = len(raw) // row
    import torch

    flat = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16)
    return flat.view(layers, 2, seq, kv_heads, head_dim)


def parse_stream_request(inputs: Mapping[str, Any], limits: Limits, kv_dims: tuple[int, int, int],
                         defaults: SamplingParams | None = None) -> tuple[ParsedRequest, StreamOptions]:
    """The plain parse of the contract inputs (KV from base64 where given), plus the stream options."""
    unknown = sorted(set(inputs) - set(STREAM_INPUT_SPECS))
    if unknown:
        raise InputError(f"{unknown[0][:40]}: unknown input; expected names from {sorted(STREAM_INPUT_SPECS)}")
    _check_request_bytes(inputs, limits)  # before decoding anything
    plain = {name: value for name, value in inputs.items() if name not in STREAM_ONLY}
    for b64_name, kv_name in B64_INPUTS.items():
        if inputs.get(b64_name) is None:
            continue
        if inputs.get(kv_name) is not None:
            raise InputError(f"{b64_name}: give one of {kv_name} and {b64_name}, not both")
        plain[kv_name] = decode_kv_b64(b64_name, inputs[b64_name], kv_dims, limits.max_prefix_tokens)
    if plain.get("COND_KV") is None:
        raise InputError("COND_KV: required input is missing (or COND_KV_B64, its base64 form)")
    parsed = parse_request(plain, limits, defaults)
    options = StreamOptions(
        preview_every=_preview_every(inputs["PREVIEW_EVERY"], limits) if inputs.get("PREVIEW_EVERY") is not None else 0,
        preview_size=_preview_size(inputs["PREVIEW_SIZE"], limits) if inputs.get("PREVIEW_SIZE") is not None else None,
        base64_output=_flag("BASE64_OUTPUT", inputs["BASE64_OUTPUT"]) if inputs.get("BASE64_OUTPUT") is not None
        else False,
    )
    return parsed, options


INPUT_LIKE = re.compile(r"^[A-Z][A-Z0-9_]*$")  # every input of the contract is spelt so; parameters never are


def refuse_input_like_parameters(parameters: str | Mapping[str, Any] | None) -> None:
    """``generate_stream`` turns a JSON field that names no input into a request parameter, and
    Triton passes parameters on without a word; an upper-case one is a misspelt or unsupported
    input (``PREVIEW_EVRY``), refused as the plain parser refuses an unknown input."""
    if not parameters:
        return
    params = json.loads(parameters) if isinstance(parameters, (str, bytes)) else parameters
    if not isinstance(params, Mapping):
        return
    for name in sorted(params):
        if isinstance(name, str) and INPUT_LIKE.match(name):
            raise InputError(f"{name[:40]}: unknown input; expected names from {sorted(STREAM_INPUT_SPECS)}")


def default_preview_size(height: int, width: int) -> tuple[int, int]:
    """The image scaled so its longer side is 256 (the image's own size if smaller)."""
    longer = max(height, width)
    if longer <= DEFAULT_PREVIEW_SIDE:
        return height, width
    scale = DEFAULT_PREVIEW_SIDE / longer
    return max(1, round(height * scale)), max(1, round(width * scale))
