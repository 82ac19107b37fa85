"""SenseNova-U1 8B generation geometry, its random tower, and a streaming sharded checkpoint writer.

One place for the shapes (from `neopp.model.checkpoint.expected_shapes`, so the keys are exactly
the ones the loader checks) and for the random values: the GPU check draws the tower on
the device, the 8B benchmark streams the same tensors into safetensors shards one tensor at
a time, so writing a 14 GB checkpoint never holds more than one tensor in memory.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from neopp.model.checkpoint import FM, ST_DTYPES, expected_shapes, layer_prefix
from neopp.model.checkpoint_config import CheckpointConfig

REAL_8B = {"num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "rope_theta": 5_000_000.0, "rope_theta_hw": 10_000.0}
MLP_WIDTH, HEAD_WIDTH, VISION_WIDTH = 12288, 4096, 1024
VISION = {"hidden_size": VISION_WIDTH, "rope_theta_vision": 10_000.0, "max_position_embeddings_vision": 1024}
# A MoE geometry of the usual fine-grained kind (assumed, not a published U1 checkpoint's).
MOE_GEOMETRY = {"num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
                "num_key_value_heads": 4, "head_dim": 128, "gen_num_experts": 128, "num_experts_per_tok": 8,
                "norm_topk_prob": True}
MOE_WIDTH = 768
ST_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}
ShapeMap = dict[str, tuple[int, ...]]


def config_8b(layers: int = 36, **llm_overrides: object) -> dict:
    """A `config.json` with the 8B generation geometry (layer count and other keys overridable)."""
    llm = {**REAL_8B, "num_hidden_layers": layers, **llm_overrides}
    return {"model_type": "neo_chat", "llm_config": llm, "vision_config": dict(VISION), "patch_size": 16}


def config_moe(layers: int = 48, experts: int = 128, top_k: int = 8) -> dict:
    return config_8b(layers, **{**MOE_GEOMETRY, "num_hidden_layers": layers, "gen_num_experts": experts,
                                "num_experts_per_tok": min(top_k, experts)})


def tower_shapes(cfg: CheckpointConfig, mlp_width: int = MLP_WIDTH, head_width: int = HEAD_WIDTH) -> ShapeMap:
    """Every generation-tower key and shape; the free widths are given as meta tensors."""
    meta = {FM + "fm_head.0.weight": torch.empty(head_width, cfg.hidden_size, device="meta")}
    for i in range(cfg.num_layers):
        m = layer_prefix(i) + "mlp_mot_gen."
        for p in [f"{m}experts.{j}." for j in range(cfg.num_experts)] or [m]:
            meta[p + "gate_proj.weight"] = torch.empty(mlp_width, cfg.hidden_size, device="meta")
    return expected_shapes(cfg, meta)


def is_norm(key: str) -> bool:
    return "layernorm" in key or "_norm" in key


def random_tensor(key: str, shape: tuple[int, ...], device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Deterministic per key (order-free): N(0, 1/fan_in) weights, unit norms, zero biases."""
    if len(shape) == 1:
        fill = torch.ones if is_norm(key) else torch.zeros
        return fill(shape, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    draw = torch.float32 if torch.device(device).type == "cpu" else dtype  # CPU: float32 randn is 2x faster
    out = torch.randn(shape, generator=gen, device=device, dtype=draw)
    return out.mul_(math.prod(shape[1:]) ** -0.5).to(dtype)


def random_tower_tensors(cfg: CheckpointConfig, device: torch.device | str, dtype: torch.dtype,
                         mlp_width: int = MLP_WIDTH, head_width: int = HEAD_WIDTH) -> dict[str, torch.Tensor]:
    """The whole tower drawn on `device` (no file)."""
    shapes = tower_shapes(cfg, mlp_width, head_width)
    return {key: random_tensor(key, shape, device, dtype) for key, shape in shapes.items()}


def write_safetensors(path: Path, shapes: ShapeMap, make: Callable[[str, tuple[int, ...]], torch.Tensor],
                      dtype: torch.dtype) -> int:
    """Stream one safetensors file: header from the shapes, then each tensor as it is made."""
    header, offset = {}, 0
    for key, shape in shapes.items():
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": ST_NAMES[dtype], "shape": list(shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(len(blob).to_bytes(8, "little"))
        out.write(blob)
        for key, shape in shapes.items():
            tensor = make(key, shape).to(dtype).contiguous()
            out.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return 8 + len(blob) + offset


def plan_shards(shapes: ShapeMap, dtype: torch.dtype, max_shard_bytes: int) -> list[ShapeMap]:
    """Consecutive keys into shards of at most `max_shard_bytes` (one tensor never splits)."""
    shards: list[ShapeMap] = [{}]
    size = 0
    for key, shape in shapes.items():
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = shape
        size += nbytes
    return shards


def with_understanding_keys(cfg: CheckpointConfig, shapes: ShapeMap) -> ShapeMap:
    """Add one small understanding-tower norm per layer, as real checkpoints hold (never loaded)."""
    out = {}
    for key, shape in shapes.items():
        out[key] = shape
        if key.endswith("input_layernorm_mot_gen.weight"):
            out[key.replace("_mot_gen", "")] = (cfg.hidden_size,)
    return out


def write_sharded_checkpoint(out_dir: Path, raw_config: dict, max_shard_bytes: int = 4 << 30,
                             dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                             mlp_width: int = MLP_WIDTH, head_width: int = HEAD_WIDTH) -> int:
    """config.json + `model-0000k-of-0000n.safetensors` + the index; returns the tensor bytes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = CheckpointConfig.from_dict(raw_config)
    shapes = with_understanding_keys(cfg, tower_shapes(cfg, mlp_width, head_width))
    shards = plan_shards(shapes, dtype, max_shard_bytes)
    weight_map, total = {}, 0
    for k, part in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out_dir / name, part,
                          lambda key, shape: random_tensor(key, shape, "cpu", dtype, seed), dtype)
        weight_map.update({key: name for key in part})
        total += sum(math.prod(s) * dtype.itemsize for s in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out_dir / "config.json").write_text(json.dumps(raw_config, indent=2))  # last: marks a complete folder
    return total
