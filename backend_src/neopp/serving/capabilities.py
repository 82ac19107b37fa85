"""What a generation model can draw, worked out once at load and advertised to every client.

The checkpoint's trained sizes narrowed by the mode file, the default size, and the one step
limit (the model's ``max_steps``): the engine's stub refuses a size outside them (unless the
operator allows untrained sizes), and the model's first instance publishes the same facts on
Triton's metrics port as the gauge ``neopp_model_capabilities{model, capabilities="<JSON>"} 1``,
which the door's ``/v1/models`` and the playground read. (Triton keeps only the inputs, outputs
and batching of an auto-completed config, so its ``parameters`` cannot carry them.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, InputError
from ..image_sizes import TrainedSizes
from ..limits import Limits
from ..model.checkpoint_config import CheckpointConfig
from ..modes import ModeSpec, load_mode
from .model_settings import TritonModelSettings

MIN_STEPS = 1


@dataclass(frozen=True)
class Capabilities:
    """The sizes a model draws well, its default size, and its step limits."""

    sizes: TrainedSizes
    default_size: tuple[int, int]  # (height, width)
    max_steps: int
    default_steps: int
    untrained_sizes: bool = False  # the operator serves sizes outside ``sizes`` too

    @staticmethod
    def of(config: CheckpointConfig, mode: ModeSpec, limits: Limits, untrained_sizes: bool,
           model: str) -> Capabilities:
        """The checked facts of ``mode`` (already fitted to ``config``) on the checkpoint."""
        sizes = config.trained_sizes.narrowed(mode.sizes)
        if sizes.declared and not sizes.listed():
            raise ConfigError(f"model {model}: the mode's sizes ({mode.sizes.describe()}) leave none of the "
                              f"checkpoint's trained sizes ({config.trained_sizes.describe()})")
        if sizes.declared and not untrained_sizes and not sizes.allows(*mode.default_size):
            raise ConfigError(f"model {model}: default size {list(mode.default_size)} is not a trained size "
                              f"({sizes.describe()}); set the checkpoint's default_image_size or the mode's "
                              "default_size to one, or allow_untrained_sizes")
        if mode.sampling_params.infer_steps > limits.max_steps:
            raise ConfigError(f"model {model}: the mode's infer_steps {mode.sampling_params.infer_steps} exceeds "
                              f"max_steps {limits.max_steps}")
        steps = mode.sampling_params.infer_steps
        return Capabilities(sizes, mode.default_size, limits.max_steps, steps, untrained_sizes)

    def check_size(self, height: int, width: int, field: str = "SIZE") -> None:
        """Refuse a size the model was not trained at, naming the range (400 at the door)."""
        if self.sizes.declared and not self.untrained_sizes and not self.sizes.allows(height, width):
            raise InputError(f"{field}: [{height}, {width}] is not a size this model was trained at; it draws "
                             f"{self.sizes.describe()} (the operator may allow untrained sizes: "
                             "allow_untrained_sizes)")

    def advertised(self) -> dict[str, Any]:
        """The ``neopp`` object of ``/v1/models``: sizes as ``WxH``, as OpenAI's ``size`` spells them,
        so a client sends one back as it is."""
        h, w = self.default_size
        offered = self.sizes.listed() or [self.default_size]
        doc: dict[str, Any] = {
            "sizes": [f"{sw}x{sh}" for sh, sw in offered], "default_size": f"{w}x{h}",
            "steps": {"min": MIN_STEPS, "max": self.max_steps}, "default_steps": self.default_steps,
            "untrained_sizes": self.untrained_sizes or not self.sizes.declared,
        }
        if self.sizes.side_range is not None:
            low, high = self.sizes.side_range
            doc["size_range"] = {"min": low, "max": high, "multiple": self.sizes.multiple}
        return doc


def model_capabilities(settings: TritonModelSettings) -> Capabilities:
    """The capabilities of a model from its settings (its mode file and checkpoint config), read
    without weights or LoRA checks, so ``auto_complete_config`` can advertise them."""
    try:
        config = CheckpointConfig.from_checkpoint(settings.checkpoint)
        mode = config.fit(load_mode(settings.mode_file, lora_dir=settings.lora_dir))
    except ConfigError as exc:
        raise ConfigError(f"model {settings.model_name}: {exc}") from exc
    return Capabilities.of(config, mode, settings.limits, settings.untrained_sizes, settings.model_name)


METRIC = "neopp_model_capabilities"


def publish(pb_utils: Any, model_name: str, capabilities: Capabilities) -> Any:
    """The gauge that carries the facts as a label; keep the returned metric (it lives as long)."""
    family = pb_utils.MetricFamily(name=METRIC, kind=pb_utils.MetricFamily.GAUGE,
                                   description="What a generation model draws (label capabilities: JSON)")
    text = json.dumps(capabilities.advertised(), separators=(",", ":"))
    metric = family.Metric(labels={"model": model_name, "capabilities": text})
    metric.set(1.0)
    return family, metric
