"""The one factory of engines: which `Engine` a mode runs on, chosen at load.

A 1-process mode runs in this process (`InProcessEngine`); a mode with several ranks runs on
rank processes (`WorkerPool`). With ``step_batching`` (the streaming models) the same choice
gives the step-batching engines instead (`BatchingEngine`, `StreamPool`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..limits import Limits
from ..model.checkpoint import default_dtype
from ..model.checkpoint_config import CheckpointConfig
from ..model.speed import SpeedOptions
from ..modes import ModeSpec
from ..parallel.parallel_pipeline import check_heads
from ..sampling.pipeline import NeoPPPipeline, set_threads
from ..sampling.plan import RequestRules
from .batch_engine import BatchingEngine
from .engine import DEFAULT_TOKEN_BUDGET, Engine, EngineHooks
from .in_process import InProcessEngine
from .rank_loop import StreamPoolSpec
from .rank_pool import PoolSpec, WorkerPool, instance_devices
from .rank_stream_pool import StreamPool


def build_engine(ckpt_dir: str | Path, mode: ModeSpec, device: str | None = None,
                 dtype: torch.dtype | None = None, limits: Limits | None = None, threads: int | None = None,
                 instance_index: int = 0, gpus: list[int] | None = None, collective_timeout_s: float = 120.0,
                 step_batching: bool = False, token_budget: int = DEFAULT_TOKEN_BUDGET,
                 hooks: EngineHooks | None = None, speed: SpeedOptions | None = None) -> Engine:
    """The engine of ``mode`` on ``ckpt_dir`` for this instance (its slice of ``gpus``);
    ``token_budget`` and ``hooks`` apply to step batching, ``speed`` to every rank."""
    limits = limits or Limits()
    speed = speed or SpeedOptions()
    set_threads(threads)
    if mode.world_size == 1:
        pipe = NeoPPPipeline.from_pretrained(ckpt_dir, mode, device, dtype, limits, speed=speed)
        return BatchingEngine(pipe, token_budget, hooks) if step_batching else InProcessEngine(pipe)
    config = CheckpointConfig.from_checkpoint(ckpt_dir)
    check_heads(config, mode)
    devices = instance_devices(mode.world_size, instance_index, gpus)
    dtype = dtype or default_dtype(torch.device(devices[0]))
    rules = RequestRules(config, limits)
    if step_batching:
        spec = StreamPoolSpec(str(ckpt_dir), mode, devices, dtype, limits, threads, collective_timeout_s,
                              speed=speed, token_budget=token_budget)
        return StreamPool(spec, rules, hooks)
    return WorkerPool(PoolSpec(str(ckpt_dir), mode, devices, dtype, limits, threads, collective_timeout_s,
                               speed=speed), rules)
