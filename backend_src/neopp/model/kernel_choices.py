"""The kernel choices a deployment makes in the server's environment, read in one place.

* ``NEOPP_ROW_TILE``: CPU products run over token rows in tiles of this many rows (default 128;
  0: whole products). A CPU GEMM blocks a product by its row count, so with one fixed tile a
  row's result depends on that row alone and a step-batched request gets its solo bytes.
* ``NEOPP_MOE_DISPATCH``: ``loop`` (default) | ``auto`` | ``grouped``, how MoE experts run.
* ``NEOPP_FP8_ACTIVATION_QUANT``: ``eager`` (default) | ``auto`` | ``compiled``, the FP8 activations'
  quantisation.

The defaults are the paths a GPU run has shown; the grouped experts and the compiled quantisation
(what ``auto`` picks on CUDA) are opt-in until a recorded GPU run shows them byte-equal to them.

Every process (a model's stub, a rank, a torchrun rank) reads its own environment once, the
first time a layer asks, never at import; a bad value is refused naming its variable.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError

MOE_DISPATCHES = ("auto", "loop", "grouped")
ACTIVATION_QUANTS = ("auto", "compiled", "eager")


@dataclass(frozen=True)
class KernelChoices:
    row_tile: int = 128
    moe_dispatch: str = "loop"
    fp8_activation_quant: str = "eager"

    @staticmethod
    def from_env(env: Mapping[str, str]) -> KernelChoices:
        tile = env.get("NEOPP_ROW_TILE", "128").strip()
        if not tile.isascii() or not tile.isdigit() or int(tile) > 1 << 20:
            raise ConfigError(f"NEOPP_ROW_TILE: a row count from 0 (whole products) to {1 << 20}, got {tile!r}")
        return KernelChoices(int(tile), check_moe_dispatch(env.get("NEOPP_MOE_DISPATCH", "loop")),
                             check_activation_quant(env.get("NEOPP_FP8_ACTIVATION_QUANT", "eager")))


def check_moe_dispatch(value: str) -> str:
    if value not in MOE_DISPATCHES:
        raise ConfigError(f"NEOPP_MOE_DISPATCH: auto, loop or grouped, got {value!r}")
    return value


def check_activation_quant(value: str) -> str:
    if value not in ACTIVATION_QUANTS:
        raise ConfigError(f"NEOPP_FP8_ACTIVATION_QUANT: auto, compiled or eager, got {value!r}")
    return value


@functools.cache
def kernel_choices() -> KernelChoices:
    """This process's choices, from its environment at the first call."""
    return KernelChoices.from_env(os.environ)
