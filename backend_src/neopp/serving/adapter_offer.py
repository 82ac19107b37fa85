"""The adapters a model offers: the files of its adapter folder that its engine would take.

``/v1/models``, ``neopp models`` and the playground list each model's adapters. A file is not
on offer because it lies in the folder: a MoE model takes attention adapters only, a mode that
merged an adapter at load would apply it a second time, and an adapter made for another
checkpoint fits none of the linears. So the model judges each file as a request naming it would
be judged (its header against the checkpoint's linear shapes, read from the checkpoint's headers
without a weight byte; its recommended values; the adapter memory bound), once per file stamp,
and publishes the names that pass with its other facts. The publisher looks again every
``REJUDGE_S`` seconds, so an adapter copied in while serving is offered, and one removed is
withdrawn, within that time.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..contract.adapter_names import LISTED, Listing, adapter_file, list_adapters
from ..errors import ConfigError, InputError
from ..model.adapter_store import AdapterDirectory
from ..model.safetensors_header import check_size, stamp_of

if TYPE_CHECKING:
    from .model_settings import TritonModelSettings

log = logging.getLogger(__name__)

REJUDGE_S = 5.0
MAX_JUDGED = 4096  # names judged per look, sorted: a folder past it offers from its first MAX_JUDGED


def merged_files(lora_configs: tuple[dict, ...]) -> tuple[Path, ...]:
    """The adapter files a mode merges at load (those that exist)."""
    return tuple(Path(entry["path"]) for entry in lora_configs if Path(entry["path"]).is_file())


@dataclass
class AdapterOffer:
    """One model's judgement of its adapter folder."""

    directory: AdapterDirectory
    shapes: dict[str, tuple[int, ...]]  # the tower's adapter targets: weight key -> shape
    merged: tuple[Path, ...]  # files the mode merged at load: never offered again
    itemsize: int  # bytes per factor element in the engine's dtype
    max_bytes: int  # the model's adapter memory bound (lora_max_bytes)
    _verdicts: dict[str, tuple[Any, bool]] = field(default_factory=dict)  # name -> (stamps, taken)

    def listing(self) -> Listing:
        """The names on offer (the first ``LISTED``, sorted) and how many there are."""
        names = list_adapters(self.directory.folder, MAX_JUDGED).names
        self._verdicts = {n: v for n, v in self._verdicts.items() if n in names}
        taken = [name for name in names if self._takes(name)]
        return Listing(tuple(taken[:LISTED]), len(taken))

    def _takes(self, name: str) -> bool:
        path = adapter_file(self.directory.folder, name)
        if path is None:
            return False
        sidecar = adapter_file(self.directory.folder, name, ".json")
        try:
            stamps = (stamp_of(path.stat()), None if sidecar is None else stamp_of(sidecar.stat()))
        except OSError:
            return False
        held = self._verdicts.get(name)
        if held is not None and held[0] == stamps:
            return held[1]
        verdict = self._judge(name, path, stamps[0])
        self._verdicts[name] = (stamps, verdict)
        return verdict

    def _judge(self, name: str, path: Path, stamp: Any) -> bool:
        from ..model.adapters import judge_adapter  # torch: only where an adapter is judged
        from ..model.lora import judge_lora_file

        if any(_same_file(path, merged) for merged in self.merged):
            log.info("adapter %s is merged into this mode at load: not offered per request", name)
            return False
        try:
            check_size(stamp[2], self.max_bytes)
            self.directory.recommended(name)
            judge_adapter(judge_lora_file(path), self.shapes, self.itemsize, self.max_bytes)
        except (ConfigError, InputError, OSError) as exc:
            log.info("adapter %s is not offered: %s", name, exc)
            return False
        return True


def adapter_offer(checkpoint: Path, lora_dir: Path | None, lora_configs: tuple[dict, ...], itemsize: int,
                  max_bytes: int) -> AdapterOffer:
    """The offer of a model whose tower is read from ``checkpoint``."""
    from ..model.adapters import is_adapter_target  # torch: only where adapters are judged
    from ..model.checkpoint import stored_shapes

    return AdapterOffer(AdapterDirectory(lora_dir), stored_shapes(checkpoint, is_adapter_target),
                        merged_files(lora_configs), itemsize, max_bytes)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def model_offer(settings: TritonModelSettings, args: dict[str, str]) -> AdapterOffer:
    """The offer of a Triton model from its settings: its mode's merged files, and its factors'
    element size in the engine's dtype (the ``dtype`` parameter, else the device's default)."""
    import torch

    from ..model.checkpoint import default_dtype
    from ..modes import load_mode
    from .model_settings import choose_device

    dtype = settings.dtype
    if dtype is None:
        device = choose_device(settings.device_param, args.get("model_instance_kind", "CPU"),
                               int(args.get("model_instance_device_id", 0) or 0), 0)
        dtype = default_dtype(torch.device(device))
    mode = load_mode(settings.mode_file, lora_dir=settings.lora_dir)
    return adapter_offer(settings.checkpoint, settings.lora_dir, mode.lora_configs,
                         torch.empty(0, dtype=dtype).element_size(), settings.lora_max_bytes)
