"""A model's speed options on CUDA: CUDA graphs of the layers, the attention kernel, compiled layers.

The defaults are exact choices: a graph replays the very kernels eager runs (and is checked
to, byte for byte, when captured), and the attention kernel is one per shape in a process. On
the CPU neither applies (there is no graph, and torch's own attention pick is kept). Compiling
the layers changes how sums round, so it is off unless a deployment asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .attention import SETTINGS, AttentionKernels, check_setting
from .cuda_graphs import DEFAULT_LIMIT, LayerGraphs, LayersFn

GRAPH_SETTINGS = ("auto", "on", "off")


@dataclass(frozen=True)
class SpeedOptions:
    """``cuda_graphs``: off (the default until a recorded GPU run shows graphs byte-equal to eager),
    auto (on for a one-process model on CUDA), on; ``attention_kernel``: default (torch's pick, the
    default), auto (the fastest per shape, measured on CUDA), flash, cudnn, efficient, math;
    ``max_graphs``: how many graphs a model keeps at once; ``compile_layers``: off, on
    (`torch.compile` fuses each layer's elementwise work: faster where launches and memory traffic
    dominate, not byte-equal to eager, compiled at the first request of a model)."""

    cuda_graphs: str = "off"
    attention_kernel: str = "default"
    max_graphs: int = DEFAULT_LIMIT
    compile_layers: str = "off"

    def __post_init__(self) -> None:
        if self.cuda_graphs not in GRAPH_SETTINGS:
            raise ConfigError(f"parameter cuda_graphs: one of {', '.join(GRAPH_SETTINGS)}, got {self.cuda_graphs!r}")
        try:
            check_setting(self.attention_kernel)
        except ValueError:
            raise ConfigError(f"parameter attention_kernel: one of {', '.join(SETTINGS)}, "
                              f"got {self.attention_kernel!r}") from None
        if self.compile_layers not in ("off", "on"):
            raise ConfigError(f"parameter compile_layers: on or off, got {self.compile_layers!r}")
        if self.max_graphs < 1:
            raise ConfigError(f"parameter max_graphs: must be positive, got {self.max_graphs}")

    def attention(self) -> AttentionKernels:
        return AttentionKernels(self.attention_kernel)

    def layer_graphs(self, run_layers: LayersFn, device: torch.device,
                     reads_host_values: bool = False) -> LayerGraphs | None:
        """The graphs of a one-process model, or None where they do not apply (``reads_host_values``:
        its step copies values to the host, as MoE experts run as a loop do)."""
        if self.cuda_graphs == "off" or (self.cuda_graphs == "auto" and (device.type != "cuda" or reads_host_values)):
            return None
        if device.type != "cuda":
            raise ConfigError(f"parameter cuda_graphs: 'on' needs a CUDA device, the model runs on {device}")
        if reads_host_values:
            raise ConfigError("parameter cuda_graphs: 'on' needs a step that stays on the device, but the MoE "
                              "experts read their token counts on the host (run as a loop: FP8 experts or "
                              "NEOPP_MOE_DISPATCH=loop; or grouped outside bf16 on compute capability 9 or 10); "
                              "use auto or off")
        return LayerGraphs(run_layers, device, self.max_graphs)
