"""One factory for every mode: a pipeline in this process, or a pool of rank processes."""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import default_dtype
from .limits import Limits
from .modes import ModeConfig
from .pipeline import NeoPPPipeline, set_threads


def build_generator(ckpt_dir: str | Path, mode: ModeConfig, device: str | None = None,
                    dtype: torch.dtype | None = None, limits: Limits | None = None, threads: int | None = None,
                    instance_index: int = 0, gpus: list[int] | None = None,
                    collective_timeout_s: float = 120.0):
    """`NeoPPPipeline` for a 1-process mode, `WorkerPool` when the mode has several ranks."""
    limits = limits or Limits()
    set_threads(threads)
    if mode.world_size == 1:
        return NeoPPPipeline.from_pretrained(ckpt_dir, mode, device, dtype, limits)
    from .parallel.engine import check_heads
    from .parallel.workers import PoolSpec, WorkerPool, instance_devices
    from .config import ModelConfig

    cfg = ModelConfig.from_checkpoint(ckpt_dir)
    check_heads(cfg, mode)
    devices = instance_devices(mode.world_size, instance_index, gpus)
    dtype = dtype or default_dtype(torch.device(devices[0]))
    spec = PoolSpec(str(ckpt_dir), mode, devices, dtype, limits, threads, collective_timeout_s)
    return WorkerPool(spec, _Validator(cfg, mode, limits))


class _Validator(NeoPPPipeline):
    """Request checks without weights: the instance process of a pool holds no tower."""

    def __init__(self, cfg, mode: ModeConfig, limits: Limits) -> None:
        super().__init__(cfg, None, mode, torch.device("cpu"), torch.float32, limits)
