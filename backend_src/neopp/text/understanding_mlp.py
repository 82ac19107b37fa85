"""The understanding tower's MLP of each layer: one SwiGLU (U1-8B), or routed experts (A3B).

A3B's understanding tower is a Qwen3-MoE stack: a layer routes each token over ``num_experts``
SwiGLU experts (``mlp.gate.weight`` scores them; the top ``num_experts_per_tok`` run, their
weights renormalised when ``norm_topk_prob``) unless it is listed in ``mlp_only_layers`` or falls
between two ``decoder_sparse_step`` layers, where a dense SwiGLU (``mlp.gate_proj`` ...) stands.
``llm_config.num_experts`` is the understanding tower's count (the generation tower reads
``gen_num_experts`` first): a checkpoint that names only ``gen_num_experts``, as the demo's MoE
does, has a dense understanding tower, as the official model reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..model.checkpoint import layer_prefix
from ..model.layers import Linear, MoE, SwiGLU

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MAX_EXPERTS = 1024


@dataclass(frozen=True)
class UnderstandingMLP:
    """Which layers route over experts, and how (``num_experts`` 0: every layer is dense)."""

    num_experts: int = 0
    top_k: int = 0
    norm_topk_prob: bool = True
    mlp_only_layers: frozenset[int] = frozenset()
    sparse_step: int = 1

    @staticmethod
    def from_llm_config(llm: dict) -> UnderstandingMLP:
        experts = _count(llm, "num_experts", 0)
        if not experts:
            return UnderstandingMLP()
        if not 0 < experts <= MAX_EXPERTS:
            raise ConfigError(f"config.json: 'llm_config.num_experts' must be in 1..{MAX_EXPERTS}, got {experts}")
        top_k = _count(llm, "num_experts_per_tok", None)
        if top_k is None or not 0 < top_k <= experts:
            raise ConfigError(f"config.json: 'llm_config.num_experts_per_tok' must be in 1..{experts} for an "
                              f"understanding tower of {experts} experts, got {top_k}")
        step = _count(llm, "decoder_sparse_step", 1) or 1
        only = llm.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(type(i) is int for i in only):
            raise ConfigError("config.json: 'llm_config.mlp_only_layers' must be a list of layer numbers, "
                              f"got {str(only)[:80]}")
        return UnderstandingMLP(experts, top_k, bool(llm.get("norm_topk_prob", True)), frozenset(only), step)

    def routed(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0

    def keys(self, layer: int) -> list[str]:
        """The layer's MLP tensors."""
        m = layer_prefix(layer) + "mlp."
        if not self.routed(layer):
            return [f"{m}{name}.weight" for name in PROJECTIONS]
        return [m + "gate.weight"] + [f"{m}experts.{j}.{name}.weight" for j in range(self.num_experts)
                                      for name in PROJECTIONS]

    def shapes(self, layer: int, hidden: int, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
        """Each MLP tensor's expected shape; the width is the first projection's, every expert alike."""
        keys = self.keys(layer)
        projections = keys[1:] if self.routed(layer) else keys
        first = tensors.get(projections[0])
        width = first.shape[0] if first is not None and first.dim() == 2 else 0
        want = {key: (hidden, width) if key.endswith("down_proj.weight") else (width, hidden) for key in projections}
        if self.routed(layer):
            want[keys[0]] = (self.num_experts, hidden)
        return want

    def build(self, layer: int, tensor: Callable[[str], torch.Tensor],
              linear: Callable[[str], Linear] | None = None) -> SwiGLU | MoE:
        """``linear``: how a projection is held (a GGUF file's blocks); the router is always a
        plain linear of ``tensor``, as in the generation tower."""
        keys = self.keys(layer)
        make = linear or (lambda key: Linear(tensor(key)))
        if not self.routed(layer):
            return SwiGLU(*(make(key) for key in keys))
        experts = [SwiGLU(*(make(key) for key in keys[1 + 3 * j:4 + 3 * j])) for j in range(self.num_experts)]
        return MoE(Linear(tensor(keys[0])), experts, self.top_k, self.norm_topk_prob)


def _count(llm: dict, key: str, default: int | None) -> int | None:
    """A whole number from ``llm_config``; absent or null: ``default``."""
    value = llm.get(key)
    if value is None:
        return default
    if type(value) is not int or value < 0:
        raise ConfigError(f"config.json: 'llm_config.{key}' must be a whole number, got {value!r}")
    return value
