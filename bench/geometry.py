"""SenseNova-U1 8B generation geometry, its random tower, and a streaming sharded checkpoint writer.

`BenchGeometry` is the one description of a benchmark tower (the CPU benchmarks' mid-size
tower, the 8B and MoE geometries of the GPU check and the 8B benchmark are instances of it).
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
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from neopp.model.checkpoint import FM, ST_DTYPES, expected_shapes, layer_prefix
from neopp.model.checkpoint_config import CheckpointConfig

ST_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}
ShapeMap = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class BenchGeometry:
    """A tower's shapes: `config()` is its config.json; `mlp` and `head_width` are the widths a
    config does not hold (per expert for MoE)."""

    layers: int = 8
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    mlp: int = 2816
    head_width: int = 1024
    vision: int = 256
    experts: int = 0  # 0: dense
    top_k: int = 0
    rope_theta: float = 1e6

    def config(self) -> dict:
        llm = {"num_hidden_layers": self.layers, "hidden_size": self.hidden, "num_attention_heads": self.heads,
               "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "rope_theta": self.rope_theta,
               "rope_theta_hw": 1e4}
        if self.experts:
            llm.update(gen_num_experts=self.experts, num_experts_per_tok=min(self.top_k, self.experts),
                       norm_topk_prob=True)
        vision = {"hidden_size": self.vision, "rope_theta_vision": 1e4, "max_position_embeddings_vision": 1024}
        return {"model_type": "neo_chat", "llm_config": llm, "vision_config": vision, "patch_size": 16}

    def shrunk(self, k: int) -> BenchGeometry:
        """Widths and head counts divided by ``k`` (head_dim kept): a CPU smoke run of a GPU geometry."""
        return replace(self, hidden=max(1, self.hidden // k), heads=max(1, self.heads // k),
                       kv_heads=max(1, self.kv_heads // k), vision=self.vision // k, mlp=self.mlp // k,
                       head_width=self.head_width // k)

    @property
    def active_mlp(self) -> int:
        """The MLP width a token passes through (the top-k experts' for MoE): what FLOP counts use."""
        return self.mlp * max(1, min(self.top_k, self.experts) if self.experts else 1)


# SenseNova-U1 8B's generation tower.
EIGHT_B = BenchGeometry(layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=12288, head_width=4096,
                        vision=1024, rope_theta=5_000_000.0)
# A MoE geometry of the usual fine-grained kind (assumed, not a published U1 checkpoint's).
MOE = replace(EIGHT_B, layers=48, hidden=2048, kv_heads=4, mlp=768, experts=128, top_k=8)


def tower_shapes(cfg: CheckpointConfig, mlp_width: int = EIGHT_B.mlp, head_width: int = EIGHT_B.head_width) -> ShapeMap:
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
                         mlp_width: int = EIGHT_B.mlp, head_width: int = EIGHT_B.head_width) -> dict[str, torch.Tensor]:
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
                             mlp_width: int = EIGHT_B.mlp, head_width: int = EIGHT_B.head_width,
                             device: str = "cpu") -> int:
    """config.json + `model-0000k-of-0000n.safetensors` + the index; returns the tensor bytes.
    ``device``: where the values are drawn (a GPU draws 7e9 of them in a second, a CPU in a minute)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = CheckpointConfig.from_dict(raw_config)
    shapes = with_understanding_keys(cfg, tower_shapes(cfg, mlp_width, head_width))
    shards = plan_shards(shapes, dtype, max_shard_bytes)
    weight_map, total = {}, 0
    for k, part in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out_dir / name, part,
                          lambda key, shape: random_tensor(key, shape, device, dtype, seed).cpu(), dtype)
        weight_map.update({key: name for key in part})
        total += sum(math.prod(s) * dtype.itemsize for s in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out_dir / "config.json").write_text(json.dumps(raw_config, indent=2))  # last: marks a complete folder
    return total
