"""Read only the generation tower from a SenseNova-U1 checkpoint, and check every shape.

Tensors are read lazily through safetensors' memory map, so the understanding tower and the
LLM embeddings of a real checkpoint are never brought into memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .checkpoint_config import CheckpointConfig
from .errors import ConfigError

LM = "language_model.model."
FM = "fm_modules."
VISION = FM + "vision_model_mot_gen.embeddings."
ATTN_LINEARS = ("q_proj_mot_gen", "k_proj_mot_gen", "v_proj_mot_gen", "o_proj_mot_gen")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)


def is_generation_key(key: str) -> bool:
    return key.startswith(FM) or (key.startswith(LM) and "mot_gen" in key)


def layer_prefix(i: int) -> str:
    return f"{LM}layers.{i}."


def _shard_map(ckpt_dir: Path) -> dict[str, Path]:
    """Key -> file, from the index when there is one, else from every safetensors file."""
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {k: ckpt_dir / f for k, f in weight_map.items() if is_generation_key(k)}
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"checkpoint {ckpt_dir}: no *.safetensors file found")
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            out.update({k: file for k in handle.keys() if is_generation_key(k)})
    return out


def _keys_by_file(ckpt_dir: Path) -> dict[Path, list[str]]:
    """The generation keys grouped by the file that holds them; a missing shard is an error."""
    by_file: dict[Path, list[str]] = {}
    for key, file in _shard_map(ckpt_dir).items():
        by_file.setdefault(file, []).append(key)
    for file in by_file:
        if not file.is_file():
            raise ConfigError(f"checkpoint {ckpt_dir}: shard {file.name} named by the index is missing")
    return by_file


def read_generation_tensors(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """All generation-tower tensors in their stored dtype, on the CPU."""
    tensors: dict[str, torch.Tensor] = {}
    for file, keys in _keys_by_file(Path(ckpt_dir)).items():
        with safe_open(str(file), framework="pt") as handle:
            for key in keys:
                tensors[key] = handle.get_tensor(key)
    return tensors


def generation_shapes(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every generation-tower tensor as a shape-only (``meta``) tensor, read from the file headers.

    Lets a load check what depends only on shapes (a LoRA's fit) in well under a second, before
    gigabytes of weights are read or rank processes started.
    """
    ckpt_dir = Path(ckpt_dir)
    shapes: dict[str, torch.Tensor] = {}
    for file, keys in _keys_by_file(ckpt_dir).items():
        with safe_open(str(file), framework="pt") as handle:
            for key in keys:
                shapes[key] = torch.empty(handle.get_slice(key).get_shape(), device="meta")
    return shapes


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
