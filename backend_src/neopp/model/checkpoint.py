"""Read only the generation tower from a SenseNova-U1 checkpoint, and check every shape.

Tensors are memory-mapped, never copied: the understanding tower and the LLM embeddings of a
real checkpoint are never brought into memory, and an 8B tower loaded on a CPU in its stored
dtype occupies the file's pages once (safetensors' `get_tensor` would copy every tensor out of
its map, holding the file twice while loading).
"""

from __future__ import annotations

import json
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from ..errors import ConfigError
from .checkpoint_config import CheckpointConfig, is_gguf
from .gguf_checkpoint import gguf_shapes, read_gguf_tensors

LM = "language_model.model."
FM = "fm_modules."
VISION = FM + "vision_model_mot_gen.embeddings."
ATTN_LINEARS = ("q_proj_mot_gen", "k_proj_mot_gen", "v_proj_mot_gen", "o_proj_mot_gen")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)


KeyFilter = Callable[[str], bool]


def is_generation_key(key: str) -> bool:
    return key.startswith(FM) or (key.startswith(LM) and "mot_gen" in key)


def layer_prefix(i: int) -> str:
    return f"{LM}layers.{i}."


def _st_dtypes() -> dict[str, torch.dtype]:
    names = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
    return {k: getattr(torch, v) for k, v in names.items() if hasattr(torch, v)}


ST_DTYPES = _st_dtypes()


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file (absolute byte offsets)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Parse a safetensors header ourselves: offsets are 64-bit and checked against the file size,
    so a truncated shard fails here naming the key instead of faulting later in a memory map."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        raw = handle.read(8)
        length = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 0 < length <= size - 8:
            raise ConfigError(f"checkpoint: {file.name} is not a safetensors file (bad header length)")
        try:
            header = json.loads(handle.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"checkpoint: {file.name} has an unreadable header ({exc})") from exc
    base, out = 8 + length, {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info.get("dtype") not in ST_DTYPES:
            raise ConfigError(f"checkpoint: tensor '{key}' in {file.name} has unsupported dtype "
                              f"{info.get('dtype')!r}")
        entry = TensorEntry(ST_DTYPES[info["dtype"]], tuple(int(d) for d in info["shape"]),
                            base + int(info["data_offsets"][0]), base + int(info["data_offsets"][1]))
        nbytes = math.prod(entry.shape) * entry.dtype.itemsize
        if entry.end - entry.start != nbytes or entry.end > size:
            raise ConfigError(f"checkpoint: tensor '{key}' in {file.name} spans bytes "
                              f"{entry.start}..{entry.end} of a {size}-byte file for {nbytes} bytes of data "
                              "(truncated or corrupt shard?)")
        out[key] = entry
    return out


def map_tensor(handle: BinaryIO, entry: TensorEntry) -> torch.Tensor:
    """A CPU tensor backed by a private (copy-on-write) map of its own bytes in the file.

    No copy is made: pages are read on first touch and, being clean file pages, can be
    dropped by the kernel under pressure. Each tensor maps only its own range, so freeing
    it (e.g. after quantising it) unmaps its pages. Writes stay private to the process.
    """
    nbytes = entry.end - entry.start
    if nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    first = entry.start - entry.start % mmap.ALLOCATIONGRANULARITY
    mapped = mmap.mmap(handle.fileno(), entry.end - first, offset=first, access=mmap.ACCESS_COPY)
    flat = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=entry.start - first)
    return flat.view(entry.dtype).view(entry.shape)


def _shard_map(ckpt_dir: Path, wanted: KeyFilter) -> dict[str, Path]:
    """Key -> file of the ``wanted`` keys, from the index when there is one, else from every
    safetensors file."""
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except json.JSONDecodeError as exc:
            raise ConfigError(f"checkpoint {ckpt_dir}: model.safetensors.index.json is not valid JSON "
                              f"({exc})") from exc
        return {k: ckpt_dir / f for k, f in weight_map.items() if wanted(k)}
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"checkpoint {ckpt_dir}: no *.safetensors file found")
    return {k: file for file in files for k in read_header(file) if wanted(k)}


def _keys_by_file(ckpt_dir: Path, wanted: KeyFilter = is_generation_key) -> dict[Path, list[str]]:
    """The wanted keys grouped by the file that holds them; a missing shard is an error."""
    by_file: dict[Path, list[str]] = {}
    for key, file in _shard_map(ckpt_dir, wanted).items():
        by_file.setdefault(file, []).append(key)
    for file in by_file:
        if not file.is_file():
            raise ConfigError(f"checkpoint {ckpt_dir}: shard {file.name} named by the index is missing")
    return by_file


def _entries(ckpt_dir: Path, file: Path, keys: list[str]) -> dict[str, TensorEntry]:
    """The header entries of ``keys`` in ``file``; an index that misplaces a key is refused."""
    entries = read_header(file)
    for key in keys:
        if key not in entries:
            raise ConfigError(f"checkpoint {ckpt_dir}: the index puts '{key}' in {file.name}, which does not hold it")
    return {key: entries[key] for key in keys}


def read_generation_tensors(ckpt_dir: str | Path, wanted: KeyFilter = is_generation_key) -> dict[str, torch.Tensor]:
    """All generation-tower tensors (or the ``wanted`` ones) in their stored dtype, on the CPU,
    memory-mapped (no copy); from a GGUF file, its quantized weights as ``GGUFWeight``."""
    if is_gguf(ckpt_dir):
        return read_gguf_tensors(ckpt_dir, wanted)
    ckpt_dir = Path(ckpt_dir)
    tensors: dict[str, torch.Tensor] = {}
    for file, keys in _keys_by_file(ckpt_dir, wanted).items():
        entries = _entries(ckpt_dir, file, keys)
        with open(file, "rb") as handle:
            for key, entry in entries.items():
                tensors[key] = map_tensor(handle, entry)
    return tensors


def stored_shapes(ckpt_dir: str | Path, wanted: KeyFilter = is_generation_key) -> dict[str, tuple[int, ...]]:
    """The shape of every ``wanted`` tensor, read from the file headers alone: what a tower will
    hold is known (a GPU layout's memory plan) without reading a byte of its weights."""
    if is_gguf(ckpt_dir):
        return gguf_shapes(ckpt_dir, wanted)
    ckpt_dir = Path(ckpt_dir)
    return {key: entry.shape
            for file, keys in _keys_by_file(ckpt_dir, wanted).items()
            for key, entry in _entries(ckpt_dir, file, keys).items()}


def generation_shapes(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every generation-tower tensor as a shape-only (``meta``) tensor, read from the file headers.

    Lets a load check what depends only on shapes (a LoRA's fit) in well under a second, before
    gigabytes of weights are read or rank processes started.
    """
    return {key: torch.empty(shape, device="meta") for key, shape in stored_shapes(ckpt_dir).items()}


def expected_shapes(config: CheckpointConfig, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Every required key and its shape; free widths (MLP, head) are read from the file."""
    D, DV, P, T = config.hidden_size, config.vision_hidden_size, config.patch_size, config.token_size
    NH, NKV, HD = config.num_heads, config.num_kv_heads, config.head_dim

    def width(key: str, dim: int) -> int:
        if key not in tensors:
            raise ConfigError(f"checkpoint: required tensor '{key}' is missing")
        return int(tensors[key].shape[dim])

    shapes = {
        VISION + "patch_embedding.weight": (DV, 3, P, P), VISION + "patch_embedding.bias": (DV,),
        VISION + "dense_embedding.weight": (D, DV, config.merge_size, config.merge_size),
        VISION + "dense_embedding.bias": (D,),
        LM + "norm_mot_gen.weight": (D,),
    }
    embedders = ["timestep_embedder"] + (["noise_scale_embedder"] if config.add_noise_scale_embedding else [])
    for emb in embedders:
        p = f"{FM}{emb}.mlp."
        shapes.update({p + "0.weight": (D, 256), p + "0.bias": (D,), p + "2.weight": (D, D), p + "2.bias": (D,)})
    if config.use_pixel_head:
        c1 = width(FM + "fm_head.conv1.weight", 0)
        shapes.update({FM + "fm_head.conv1.weight": (c1, D // 4, 3, 3), FM + "fm_head.conv1.bias": (c1,),
                       FM + "fm_head.conv2.weight": (3 * 64, c1 // 4, 3, 3), FM + "fm_head.conv2.bias": (3 * 64,)})
    else:
        dh = width(FM + "fm_head.0.weight", 0)
        shapes.update({FM + "fm_head.0.weight": (dh, D), FM + "fm_head.0.bias": (dh,),
                       FM + "fm_head.2.weight": (T * T * 3, dh), FM + "fm_head.2.bias": (T * T * 3,)})
    for i in range(config.num_layers):
        p = layer_prefix(i)
        a = p + "self_attn."
        shapes.update({
            p + "input_layernorm_mot_gen.weight": (D,), p + "post_attention_layernorm_mot_gen.weight": (D,),
            a + "q_proj_mot_gen.weight": (NH * HD, D), a + "k_proj_mot_gen.weight": (NKV * HD, D),
            a + "v_proj_mot_gen.weight": (NKV * HD, D), a + "o_proj_mot_gen.weight": (D, NH * HD),
        })
        for norm in ("q_norm_mot_gen", "k_norm_mot_gen", "q_norm_hw_mot_gen", "k_norm_hw_mot_gen"):
            shapes[a + norm + ".weight"] = (HD // 2,)
        m = p + "mlp_mot_gen."
        if config.is_moe:
            shapes[m + "gate.weight"] = (config.num_experts, D)
            for j in range(config.num_experts):
                shapes.update(_mlp_shapes(f"{m}experts.{j}.", D, width(f"{m}experts.{j}.gate_proj.weight", 0)))
        else:
            shapes.update(_mlp_shapes(m, D, width(m + "gate_proj.weight", 0)))
    return shapes


def _mlp_shapes(prefix: str, D: int, F: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (F, D), prefix + "up_proj.weight": (F, D), prefix + "down_proj.weight": (D, F)}


def check_shapes(config: CheckpointConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Name the first key that is missing or disagrees with config.json."""
    for key, shape in expected_shapes(config, tensors).items():
        if key not in tensors:
            raise ConfigError(f"checkpoint: required tensor '{key}' is missing")
        got = tuple(tensors[key].shape)
        if got != shape:
            raise ConfigError(f"checkpoint: tensor '{key}' has shape {got}, config.json implies {shape}")
    for key, tensor in tensors.items():
        if key.endswith(".weight_scale"):
            weight = key[: -len("_scale")]
            if weight not in tensors or tensor.numel() != tensors[weight].shape[0]:
                raise ConfigError(f"checkpoint: '{key}' must hold one scale per output channel of '{weight}'")


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA; float32 on CPU (exactness tests), overridable by the caller."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_checkpoint(ckpt_dir: str | Path) -> tuple[CheckpointConfig, dict[str, torch.Tensor]]:
    config = CheckpointConfig.from_checkpoint(ckpt_dir)
    tensors = read_generation_tensors(ckpt_dir)
    check_shapes(config, tensors)
    return config, tensors
