"""The factories of every mode's engines, and the interface the plain engines offer the serving layer.

A 1-process mode runs a :class:`NeoPPPipeline` in this process; a mode with several ranks runs a
:class:`WorkerPool` of rank processes. Callers see only :class:`GenerationEngine`. The streaming
models' engines (:class:`StreamEngine`: step-batching, in this process or on a rank pool) come
from :func:`build_stream_engine`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..limits import Limits
from ..model.checkpoint import default_dtype
from ..model.checkpoint_config import CheckpointConfig
from ..modes import ModeSpec
from ..parallel.parallel_pipeline import check_heads
from ..parallel.stream_pool import build_stream_pool
from ..parallel.workers import PoolSpec, WorkerPool, instance_devices
from ..request import GenerationRequest, RequestRules
from ..sampling.pipeline import NeoPPPipeline, StepFn, StopFn, set_threads
from .batch_engine import BatchingEngine
from .streaming import DEFAULT_TOKEN_BUDGET, EngineHooks, StreamEngine


class GenerationEngine(Protocol):
    """What the Triton models, the runner and the replay tools call, whatever runs the steps."""

    config: CheckpointConfig
    mode: ModeSpec
    rules: RequestRules

    def validate(self, req: GenerationRequest) -> None: ...

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
    config = CheckpointConfig.from_checkpoint(ckpt_dir)
    check_heads(config, mode)
    devices = instance_devices(mode.world_size, instance_index, gpus)
    dtype = dtype or default_dtype(torch.device(devices[0]))
    spec = PoolSpec(str(ckpt_dir), mode, devices, dtype, limits, threads, collective_timeout_s)
    return WorkerPool(spec, RequestRules(config, limits))


def build_stream_engine(ckpt_dir: str | Path, mode: ModeSpec, device: str | None = None,
                        dtype: torch.dtype | None = None, limits: Limits | None = None, threads: int | None = None,
                        token_budget: int = DEFAULT_TOKEN_BUDGET, hooks: EngineHooks | None = None,
                        instance_index: int = 0, gpus: list[int] | None = None,
                        collective_timeout_s: float = 120.0) -> StreamEngine:
    """A `BatchingEngine` for a 1-process mode, a `StreamPool` of rank processes otherwise."""
    limits = limits or Limits()
    set_threads(threads)
    if mode.world_size == 1:
        pipe = NeoPPPipeline.from_pretrained(ckpt_dir, mode, device, dtype, limits)
        return BatchingEngine(pipe, token_budget, hooks)
    return build_stream_pool(ckpt_dir, mode, dtype, limits, threads, token_budget, hooks, instance_index, gpus,
                             collective_timeout_s)
