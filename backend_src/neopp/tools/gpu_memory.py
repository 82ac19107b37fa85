"""What one model holds on each of its GPUs, from its checkpoint's files alone.

A layout is planned for the checkpoint it will serve, not for the 8B figures of the deployment
guide: the geometry comes from the checkpoint's ``config.json`` (``CheckpointConfig``) and every
tensor's shape from its safetensors headers (``stored_shapes``; no weight is read). The formulas
are the guide's ("Memory per GPU", docs/deployment.md), for one request at the model's limits
(``max_prefix_tokens`` per branch, images of ``max_pixels``):

* weights: every tensor of the tower in bf16, whatever its stored dtype (a float32 U1.5 branch is
  cast at load, the 8-step LoRA is merged, an MoE keeps every expert); FP8: the layer linears one
  byte each plus a float32 scale per output row, the rest bf16. Each rank holds them all;
* KV prefix: one prefix per branch the rank holds (both for a one-GPU mode with CFG, one for a
  CFG rank or a mode without CFG), a Ulysses rank its share of the heads;
* activations: one layer's values for the rank's image-token rows, and that layer's K and V over
  prefix and image tokens per branch;
* 1 GB per process for the CUDA context and the allocator's slack.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..contract.inputs import MAX_THINK_TOKENS
from ..errors import ConfigError
from ..limits import Limits
from ..model.checkpoint import ATTN_LINEARS, LM, MLP_LINEARS, layer_prefix, stored_shapes
from ..model.checkpoint_config import CheckpointConfig
from ..modes import ModeSpec
from ..text.language_tower import is_language_key
from ..text.prompt_ids import MAX_PREFIX_TOKENS

GB = 10**9
CONTEXT_BYTES = GB  # a process's CUDA context and allocator slack
BF16 = 2
SCALE_BYTES = 4  # FP8: one float32 scale per output row of a layer linear
_LINEARS = frozenset(ATTN_LINEARS + MLP_LINEARS)


def gb(nbytes: float) -> str:
    return f"{nbytes / GB:.1f}"


@dataclass(frozen=True)
class TowerSizes:
    """One tower's geometry and the bytes it holds on a GPU."""

    config: CheckpointConfig
    bf16_bytes: int
    fp8_bytes: int
    mlp_values: int  # values one activation row keeps in the MLP: gate, up and product (x top-k for MoE)

    @staticmethod
    def from_shapes(config: CheckpointConfig, shapes: Mapping[str, Sequence[int]], mlp_key: str,
                    experts_per_row: int = 1) -> TowerSizes:
        """``shapes``: every tensor the tower loads; ``mlp_key``: a gate projection, whose rows are
        the MLP (or one expert's) width."""
        if mlp_key not in shapes:
            raise ConfigError(f"checkpoint: required tensor '{mlp_key}' is missing")
        held = {key: math.prod(shape) for key, shape in shapes.items() if not key.endswith("_scale")}
        linears = [shapes[key] for key in held if _is_layer_linear(key)]
        bf16 = BF16 * sum(held.values())
        fp8 = bf16 - sum(math.prod(s) for s in linears) * (BF16 - 1) + sum(SCALE_BYTES * s[0] for s in linears)
        return TowerSizes(config, bf16, fp8, 3 * experts_per_row * int(shapes[mlp_key][0]))

    @property
    def kv_token_bytes(self) -> int:
        """One prefix token's K and V over every layer (144 KiB for the 8B tower)."""
        c = self.config
        return c.num_layers * 2 * c.num_kv_heads * c.head_dim * BF16

    @property
    def row_bytes(self) -> int:
        """One activation row through one layer: residual, norm, q, attention output, k, v, MLP."""
        c = self.config
        return (2 * c.hidden_size + 2 * c.num_heads * c.head_dim + 2 * c.num_kv_heads * c.head_dim
                + self.mlp_values) * BF16


def _is_layer_linear(key: str) -> bool:
    return key.startswith(LM + "layers.") and key.endswith(".weight") and key.split(".")[-2] in _LINEARS


def generation_sizes(config: CheckpointConfig, shapes: Mapping[str, Sequence[int]]) -> TowerSizes:
    """The generation tower (dense, or MoE with every expert resident)."""
    mlp = layer_prefix(0) + "mlp_mot_gen." + ("experts.0." if config.is_moe else "") + "gate_proj.weight"
    return TowerSizes.from_shapes(config, shapes, mlp, max(1, config.num_experts_per_tok))


def language_sizes(config: CheckpointConfig, shapes: Mapping[str, Sequence[int]]) -> TowerSizes:
    """The understanding tower the prompt encoder loads (embedding, layers, ``lm_head``)."""
    return TowerSizes.from_shapes(config, shapes, layer_prefix(0) + "mlp.gate_proj.weight")


def generation_tower(ckpt_dir: str | Path) -> TowerSizes:
    config = CheckpointConfig.from_checkpoint(ckpt_dir)
    return generation_sizes(config, stored_shapes(ckpt_dir))


def language_tower(ckpt_dir: str | Path) -> TowerSizes:
    config = CheckpointConfig.from_checkpoint(ckpt_dir)
    return language_sizes(config, stored_shapes(ckpt_dir, is_language_key))


@dataclass(frozen=True)
class Need:
    """Bytes one process holds on one GPU."""

    weights: int
    kv: int
    activations: int
    context: int = CONTEXT_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations + self.context

    def describe(self) -> str:
        return (f"{gb(self.total)} GB: {gb(self.weights)} weights + {gb(self.kv)} KV + "
                f"{gb(self.activations)} activations + {gb(self.context)} context")


def rank_need(mode: ModeSpec, tower: TowerSizes, limits: Limits) -> Need:
    """What each rank of ``mode`` holds on its GPU for one request at ``limits``."""
    c = tower.config
    branches = 1 if mode.cfg_p_size > 1 or not mode.sampling_params.enable_cfg else 2
    prefix, image = limits.max_prefix_tokens, limits.max_pixels // c.token_size ** 2
    per_layer_kv = tower.kv_token_bytes // c.num_layers
    kv = branches * prefix * tower.kv_token_bytes
    activations = branches * image * tower.row_bytes + branches * (prefix + image) * per_layer_kv
    weights = tower.fp8_bytes if mode.dit_quantized else tower.bf16_bytes
    return Need(weights, kv // mode.seq_p_size, activations // mode.seq_p_size)


def encoder_need(tower: TowerSizes) -> Need:
    """The prompt encoder on a GPU (bf16): its tower, the cache of its longest prefix and reasoning,
    and the activations of that prefix."""
    tokens = MAX_PREFIX_TOKENS + MAX_THINK_TOKENS
    per_layer_kv = tower.kv_token_bytes // tower.config.num_layers
    return Need(tower.bf16_bytes, tokens * tower.kv_token_bytes,
                MAX_PREFIX_TOKENS * tower.row_bytes + tokens * per_layer_kv)
