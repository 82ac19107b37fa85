"""Adapter files written byte by byte, good and bad, for the tests of the adapter judge.

``raw_safetensors`` lays out a file exactly as given (header JSON, then the tensors' bytes), so a
test can write what no library would: FP8 factors, a rank-0 pair with an alpha, a NaN alpha, a
header nested many thousand levels deep, a folder of 20,000 names, a file far over the byte bound.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from neopp.contract.adapter_names import SUFFIX

Q_SUFFIX = "q_proj_mot_gen.weight"
ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
             torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int32: "I32"}


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def raw_safetensors(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """A safetensors file of ``tensors`` in order, any dtype of ST_DTYPES."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    data = b""
    for key, t in tensors.items():
        raw = tensor_bytes(t)
        span = [len(data), len(data) + len(raw)]
        header[key] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": span}
        data += raw
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def write_file(folder: Path, name: str, content: bytes) -> Path:
    path = Path(folder) / (name + SUFFIX)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def q_target(shapes: Mapping[str, tuple[int, ...]]) -> tuple[str, int, int]:
    """The first layer's q projection: (its LoRA base key, out features, in features)."""
    key = sorted(k for k in shapes if k.endswith(Q_SUFFIX))[0]
    out_f, in_f = shapes[key]
    return key[: -len(".weight")], out_f, in_f


def pair(base: str, up: torch.Tensor, down: torch.Tensor, alpha: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    out = {base + ".lora_up.weight": up, base + ".lora_down.weight": down}
    if alpha is not None:
        out[base + ".alpha"] = alpha
    return out


def fp8_values(rows: int, cols: int, seed: int, scale: float) -> torch.Tensor:
    """Random values that FP8 (e4m3) holds exactly, as float32."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=gen) * scale).to(torch.float8_e4m3fn).float()


def fp8_pair_files(folder: Path, shapes: Mapping[str, tuple[int, ...]], rank: int = 4) -> tuple[Path, Path]:
    """``fp8`` (factors stored F8_E4M3) and ``fp8_as_f32`` (the same values in float32)."""
    base, out_f, in_f = q_target(shapes)
    up, down = fp8_values(out_f, rank, 1, 0.25), fp8_values(rank, in_f, 2, 0.25)
    alpha = torch.tensor(float(rank))
    return (write_file(folder, "fp8", raw_safetensors(pair(base, up.to(torch.float8_e4m3fn),
                                                           down.to(torch.float8_e4m3fn), alpha))),
            write_file(folder, "fp8_as_f32", raw_safetensors(pair(base, up, down, alpha))))


def rank0_alpha(folder: Path, shapes: Mapping[str, tuple[int, ...]], name: str = "rank0") -> Path:
    base, out_f, in_f = q_target(shapes)
    return write_file(folder, name, raw_safetensors(pair(base, torch.zeros(out_f, 0), torch.zeros(0, in_f),
                                                         torch.tensor(4.0))))


def with_alpha(folder: Path, shapes: Mapping[str, tuple[int, ...]], name: str, alpha: float) -> Path:
    base, out_f, in_f = q_target(shapes)
    gen = torch.Generator().manual_seed(3)
    return write_file(folder, name, raw_safetensors(pair(base, torch.randn(out_f, 2, generator=gen) * 0.1,
                                                         torch.randn(2, in_f, generator=gen) * 0.1,
                                                         torch.tensor(alpha))))


def nested_header(folder: Path, name: str = "nested", depth: int = 100_000) -> Path:
    text = b'{"a": ' + b"[" * depth + b"]" * depth + b"}"
    return write_file(folder, name, struct.pack("<Q", len(text)) + text)


def many_names(folder: Path, count: int, prefix: str = "n") -> None:
    """``count`` empty adapter files (named, never read)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        with open(folder / f"{prefix}{i:05d}{SUFFIX}", "wb"):
            pass


def sparse_file(folder: Path, name: str, size: int) -> Path:
    """A file of ``size`` bytes that takes no disk (reading it all would take ``size`` of memory)."""
    path = Path(folder) / (name + SUFFIX)
    with open(path, "wb") as handle:
        handle.truncate(size)
    return path


def rewrite_keeping_stamp(path: Path, content: bytes) -> None:
    """Overwrite ``path`` in place with content of its size and give it back its modification time:
    a file the server must not tell from the one it judged."""
    info = path.stat()
    assert len(content) == info.st_size
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, content, 0)
    finally:
        os.close(fd)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
