"""`EngineSpec`: everything an engine needs to run a mode, in one bundle.

What to load (checkpoint, mode), where (one device per rank), in which dtype, how fast (threads,
speed options), the request bounds (limits) and how much it runs at once (the step budget, the
queue bound). The serving layer fills it from a model's ``config.pbtxt``; benchmarks, tests and
the LightX2V facade write one directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..limits import Limits
from ..model.speed import SpeedOptions
from ..modes import ModeSpec
from .scheduler import DEFAULT_MAX_QUEUED, DEFAULT_PATIENCE, DEFAULT_TOKEN_BUDGET


@dataclass(frozen=True)
class EngineSpec:
    checkpoint: str
    mode: ModeSpec = ModeSpec()
    devices: tuple[str, ...] = ("cpu",)  # one per rank: ("cpu",), ("cuda:0", "cuda:1"), ...
    dtype: torch.dtype | None = None     # None: bf16 on a GPU, float32 on the CPU
    limits: Limits = Limits()
    threads: int | None = None           # torch CPU threads per process
    measure_threads: bool = False        # one CPU process: time a step on 1, 2, 4... up to threads, keep the fastest
    collective_timeout_s: float = 120.0
    load_timeout_s: float = 600.0
    speed: SpeedOptions = SpeedOptions()
    token_budget: int = DEFAULT_TOKEN_BUDGET
    max_queued: int = DEFAULT_MAX_QUEUED
    patience: int = DEFAULT_PATIENCE
    lora_dir: str | None = None          # the adapters a request may name (LORA); None: none
    lora_max_bytes: int = 1 << 30        # resident adapters' bytes, least recently used evicted past it
    torchrun_rank: bool = False          # this process is one rank of a torchrun launch (LightX2V's way)

    @classmethod
    def local(cls, checkpoint: str | Path, mode: ModeSpec, device: str | None = None, **options: Any) -> EngineSpec:
        """A spec on this machine's devices: ``device`` (default: the first GPU, else the CPU) for a
        one-process mode, the first ``world_size`` GPUs (or the CPU) for a multi-rank one."""
        if mode.world_size == 1:
            devices: tuple[str, ...] = (device or ("cuda" if torch.cuda.is_available() else "cpu"),)
        else:
            devices = instance_devices(mode.world_size)
        return cls(str(checkpoint), mode, devices, **options)

    @property
    def silence_s(self) -> float:
        """No heartbeat from a rank for this long fails its requests: well under the collective
        timeout, yet long enough that a busy machine does not starve a healthy rank's heartbeat."""
        return min(30.0, max(2.0, self.collective_timeout_s / 4))


def instance_devices(world_size: int, instance_index: int = 0, gpus: list[int] | None = None) -> tuple[str, ...]:
    """Devices of one instance's ranks: disjoint GPU sets per instance, else the CPU."""
    if not torch.cuda.is_available():
        return ("cpu",) * world_size
    gpus = gpus if gpus is not None else list(range(torch.cuda.device_count()))
    first = instance_index * world_size
    if first + world_size > len(gpus):
        raise ConfigError(f"instance {instance_index} needs GPUs {first}..{first + world_size - 1} "
                          f"but only {len(gpus)} are available ({gpus}); lower the instance count")
    return tuple(f"cuda:{g}" for g in gpus[first:first + world_size])
