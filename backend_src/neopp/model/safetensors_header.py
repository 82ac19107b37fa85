"""A safetensors file judged from its header, then read once into memory, tensor by tensor.

A LoRA file is named by a client (through its adapter's name) and rewritten by an operator while
the server runs, so it is read here rather than memory-mapped: a file cut short underneath gives a
short read and a refusal, never a fault in the process. The header is parsed strictly before any
tensor byte is read: bounded length and nesting (no recursion on a hostile header), no duplicate
key, float dtypes only, shapes that match their byte ranges, and ranges that tile the data
exactly. Messages name what broke the rule, never a path or the file's bytes; a key is shown
shortened and escaped.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:  # torch is imported where a tensor is read: the request parsers judge names without it
    import torch

MAX_HEADER_BYTES = 16 << 20  # some 100,000 tensors' entries; a LoRA of every expert of a 128-expert tower has 40,000
MAX_DEPTH = 3                # the header object, a tensor's object, its shape list
MAX_DIMS = 8
KEY_SHOWN = 96
# Float dtypes only. FP8 factors are upcast when read: every FP8 value is exact in bf16 and float32.
DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
          "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1)}  # name: (torch dtype, bytes)
_STRINGS = re.compile(rb'"(?:[^"\\\n]|\\.)*"')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_INNERMOST = re.compile(rb"[\[{][\]}]")

Stamp = tuple[int, int, int, int]  # (device, inode, size, mtime_ns): what tells a file replaced or rewritten


class FileChanged(ConfigError):
    """The file changed while it was read: this read is refused, the next one may succeed."""


def key_shown(key: str) -> str:
    """A key of the file as a message may show it: escaped to ASCII and shortened."""
    return ascii(key[:KEY_SHOWN]) + ("..." if len(key) > KEY_SHOWN else "")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the header: its key, dtype name, shape and byte range within the data."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    """A parsed header: the tensors by key, the ``__metadata__`` strings, where the data starts."""

    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int


def stamp_of(info: os.stat_result) -> Stamp:
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def check_size(size: int, max_bytes: int | None) -> None:
    """A file over ``max_bytes`` is refused from its size alone (the model's ``lora_max_bytes``)."""
    if max_bytes is not None and size > max_bytes:
        raise ConfigError(f"its file of {size} bytes is over the bound of {max_bytes} (parameter lora_max_bytes)")


def open_regular(path: Path) -> int:
    """A read-only descriptor of a regular file (no FIFO waits, a link is not followed)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ConfigError(f"its file cannot be opened ({exc.strerror or 'error'})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError("its file is not a regular file")
    return fd


def read_exactly(fd: int, offset: int, size: int) -> bytearray:
    """``size`` bytes at ``offset``; a file now shorter is FileChanged."""
    out = bytearray(size)
    view, done = memoryview(out), 0
    while done < size:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise FileChanged("its file changed while it was read (it became shorter)")
        done += got
    return out


def read_small(path: Path, limit: int, what: str) -> bytes:
    """A small regular file in full (a sidecar), at most ``limit`` bytes."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise ConfigError(f"{what} is over {limit} bytes")
        return bytes(read_exactly(fd, 0, size))
    finally:
        os.close(fd)


def nests_within(raw: bytes, max_depth: int) -> bool:
    """Whether JSON text nests at most ``max_depth`` brackets deep (outside strings), found without
    parsing it (so without recursion): each pass drops the innermost pairs, and after
    ``max_depth`` passes nothing may be left (an unbalanced text is refused too)."""
    bare = _STRINGS.sub(b'""', raw).translate(None, _NOT_BRACKETS)
    for _ in range(max_depth):
        bare = _INNERMOST.sub(b"", bare)
    return not bare


def strict_json(raw: bytes, max_depth: int, where: str = "its header") -> Any:
    """JSON text, nesting at most ``max_depth``, no duplicate key, no NaN or infinity literal;
    ConfigError starting with ``where``."""
    if not nests_within(raw, max_depth):
        raise ConfigError(f"{where} nests deeper than {max_depth} levels")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            raise ConfigError(f"{where} names one key twice")
        return out

    def no_constant(word: str) -> None:
        raise ConfigError(f"{where} holds {word}, which is not JSON")

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates, parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{where} is not JSON text") from None


def _index(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ConfigError(f"{what} must be non-negative integers")
    return value


def _entry(key: str, value: Any) -> TensorEntry:
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data_offsets"}:
        raise ConfigError(f"tensor {key_shown(key)} must have exactly dtype, shape and data_offsets")
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if dtype not in DTYPES:
        raise ConfigError(f"tensor {key_shown(key)} has dtype {key_shown(str(dtype))}; a LoRA's tensors are floats "
                          f"({', '.join(DTYPES)})")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not isinstance(offsets, list) or len(offsets) != 2:
        raise ConfigError(f"tensor {key_shown(key)}: shape must be a list of at most {MAX_DIMS} sizes and "
                          "data_offsets a [begin, end] pair")
    dims = tuple(_index(d, f"tensor {key_shown(key)}: shape sizes") for d in shape)
    begin, end = (_index(o, f"tensor {key_shown(key)}: data_offsets") for o in offsets)
    if end - begin != math.prod(dims) * DTYPES[dtype][1]:
        raise ConfigError(f"tensor {key_shown(key)}: data_offsets span {end - begin} bytes; shape {list(dims)} "
                          f"of {dtype} takes {math.prod(dims) * DTYPES[dtype][1]}")
    return TensorEntry(key, dtype, dims, begin, end)


def parse_header(raw: bytes, data_start: int, data_bytes: int) -> Header:
    """The header's JSON, checked against ``data_bytes`` (the file's bytes after the header)."""
    doc = strict_json(raw, MAX_DEPTH, "its header")
    if not isinstance(doc, dict):
        raise ConfigError("its header is not a JSON object")
    meta = doc.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ConfigError("its header's __metadata__ must map names to strings")
    entries = {key: _entry(key, value) for key, value in doc.items()}
    at = 0
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != at:
            raise ConfigError(f"tensor {key_shown(entry.key)}: data_offsets leave a gap or overlap another tensor")
        at = entry.end
    if at != data_bytes:
        raise ConfigError(f"the tensors cover {at} bytes of data; the file holds {data_bytes}")
    return Header(entries, meta, data_start)


def read_header(fd: int, file_size: int) -> Header:
    """The header of an open file of ``file_size`` bytes, checked; no tensor byte is read."""
    if file_size < 8:
        raise ConfigError("its file is not a safetensors file (shorter than its header length)")
    (length,) = struct.unpack("<Q", bytes(read_exactly(fd, 0, 8)))
    if not 2 <= length <= min(MAX_HEADER_BYTES, file_size - 8):
        raise ConfigError(f"its file is not a safetensors file (its header length is not within the file and "
                          f"{MAX_HEADER_BYTES >> 20} MiB)")
    return parse_header(bytes(read_exactly(fd, 8, length)), 8 + length, file_size - 8 - length)


def read_tensor(fd: int, header: Header, entry: TensorEntry) -> torch.Tensor:
    """One tensor's bytes, read into memory of its own (little-endian host); FP8 upcast to float32."""
    import torch

    dtype = getattr(torch, DTYPES[entry.dtype][0])
    if entry.numel == 0:
        return torch.empty(entry.shape, dtype=dtype)
    data = read_exactly(fd, header.data_start + entry.begin, entry.end - entry.begin)
    tensor = torch.frombuffer(data, dtype=dtype).reshape(entry.shape)
    return tensor.float() if entry.dtype.startswith("F8") else tensor
