"""One factory for every mode, and the interface both engines offer the serving layer.

A 1-process mode runs a :class:`NeoPPPipeline` in this process; a mode with several ranks runs a
:class:`WorkerPool` of rank processes. Callers see only :class:`GenerationEngine`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from .checkpoint import default_dtype
from .checkpoint_config import CheckpointConfig
from .limits import Limits
from .modes import ModeSpec
from .pipeline import GenerationRequest, NeoPPPipeline, StepFn, StopFn, set_threads
from .request_rules import RequestRules


class GenerationEngine(Protocol):
    """What the Triton models, the runner and the replay tools call, whatever runs the steps."""

    config: CheckpointConfig
    mode: ModeSpec
    rules: RequestRules

    def validate(self, req: GenerationRequest) -> None: ...

    def guidance_plan(self, req: GenerationRequest) -> list[bool]: ...

    def generate(self, req: GenerationRequest, should_stop: StopFn | None = None,
                 on_step: StepFn | None = None) -> np.ndarray: ...

    def close(self) -> None: ...


def build_engine(ckpt_dir: str | Path, mode: ModeSpec, device: str | None = None,
                    dtype: torch.dtype | None = None, limits: Limits | None = None, threads: int | None = None,
                    instance_index: int = 0, gpus: list[int] | None = None,
                    collective_timeout_s: float = 120.0) -> GenerationEngine:
    """`NeoPPPipeline` for a 1-process mode, `WorkerPool` when the mode has several ranks."""
    limits = limits or Limits()
    set_threads(threads)
    if mode.world_size == 1:
        return NeoPPPipeline.from_pretrained(ckpt_dir, mode, device, dtype, limits)
    from .parallel.engine import check_heads
    from .parallel.workers import PoolSpec, WorkerPool, instance_devices

    config = CheckpointConfig.from_checkpoint(ckpt_dir)
    check_heads(config, mode)
    devices = instance_devices(mode.world_size, instance_index, gpus)
    dtype = dtype or default_dtype(torch.device(devices[0]))
    spec = PoolSpec(str(ckpt_dir), mode, devices, dtype, limits, threads, collective_timeout_s)
    return WorkerPool(spec, RequestRules(config, limits))
