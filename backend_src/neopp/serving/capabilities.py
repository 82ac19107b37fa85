"""What a generation model can draw, worked out once at load and advertised to every client.

The checkpoint's trained sizes narrowed by the mode file, the default size, and the one step
limit (the model's ``max_steps``): the engine's stub refuses a size outside them (unless the
operator allows untrained sizes), and the model's first instance publishes the same facts on
Triton's metrics port (``neopp.contract.published_facts``) with the adapters it offers
(``adapter_offer``), which the door's ``/v1/models``, ``neopp models`` and the playground read.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..contract.adapter_names import Listing
from ..contract.published_facts import ADAPTER_METRIC, ADAPTERS_METRIC, CAPABILITIES_METRIC
from ..errors import ConfigError, InputError
from ..image_sizes import TrainedSizes
from ..limits import Limits
from ..model.checkpoint_config import CheckpointConfig
from ..modes import ModeSpec, load_mode
from .adapter_offer import REJUDGE_S, AdapterOffer
from .model_settings import TritonModelSettings

log = logging.getLogger(__name__)

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


MAX_PUBLISHED = 1000  # adapter names a model publishes in its life: Triton cannot remove a line
LOOK_SHARE = 20  # a look at the adapter folder waits at least 20 times as long as it took


class PublishedFacts:
    """A model's facts on Triton's metrics port: its capabilities as one line that never changes,
    and the adapters it offers as a line each, judged again every ``REJUDGE_S`` seconds.

    Triton's python backend removes a metric only with its family, so a withdrawn adapter's line
    stays at 0; after ``MAX_PUBLISHED`` names the list stays as it is until the model reloads.
    The new names are set before the count and the withdrawn ones after it: a reader checks the
    names on offer against the count and keeps its last complete list while they disagree."""

    def __init__(self, pb_utils: Any, model_name: str, capabilities: Capabilities,
                 offer: AdapterOffer | None) -> None:
        gauge = pb_utils.MetricFamily.GAUGE
        family = pb_utils.MetricFamily(name=CAPABILITIES_METRIC, kind=gauge,
                                       description="What a generation model draws (label capabilities: JSON)")
        self._capabilities = family, family.Metric(labels={
            "model": model_name, "capabilities": json.dumps(capabilities.advertised(), separators=(",", ":"))})
        self._capabilities[1].set(1.0)
        self._adapter = pb_utils.MetricFamily(name=ADAPTER_METRIC, kind=gauge,
                                              description="An adapter a generation model offers (1), or withdrew (0)")
        adapters = pb_utils.MetricFamily(name=ADAPTERS_METRIC, kind=gauge,
                                         description="How many adapters a generation model offers")
        self._total = adapters, adapters.Metric(labels={"model": model_name})
        self.model_name, self.offer = model_name, offer
        self._lines: dict[str, Any] = {}
        self._full = False
        self.listing = Listing((), 0)
        self._publish(offer.listing() if offer is not None else self.listing)
        self._stop = threading.Event()
        self._thread = None
        if offer is not None and offer.directory.folder is not None:
            self._thread = threading.Thread(target=self._watch, name="neopp-adapter-offer", daemon=True)
            self._thread.start()

    def _publish(self, listing: Listing) -> None:
        new = [n for n in listing.names if n not in self._lines or n not in self.listing.names]
        if len(set(self._lines) | set(new)) > MAX_PUBLISHED:
            if not self._full:
                log.warning("%s: over %d adapter names published; the list stays until the model reloads",
                            self.model_name, MAX_PUBLISHED)
            self._full = True
            return
        for name in new:
            if name not in self._lines:
                self._lines[name] = self._adapter.Metric(labels={"model": self.model_name, "adapter": name})
            self._lines[name].set(1.0)
        self._total[1].set(float(listing.total))
        for name in set(self.listing.names) - set(listing.names):
            self._lines[name].set(0.0)
        self.listing = listing

    def _watch(self) -> None:
        """Look every REJUDGE_S seconds, or less often where a look takes long (a folder of
        thousands of files): looking never takes more than 1/LOOK_SHARE of this process's time."""
        wait = REJUDGE_S
        while not self._stop.wait(wait):
            started = time.monotonic()
            try:
                listing = self.offer.listing()
                if listing != self.listing:
                    self._publish(listing)
            except Exception:  # noqa: BLE001 - a look that fails leaves the last facts; the next looks again
                log.exception("%s: judging the adapter folder failed", self.model_name)
            wait = max(REJUDGE_S, LOOK_SHARE * (time.monotonic() - started))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * REJUDGE_S)
