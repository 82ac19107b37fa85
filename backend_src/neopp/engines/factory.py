"""The one factory of engines: which `Engine` a mode runs on, chosen at load.

A one-process mode runs in this process (`BatchingEngine` over one pipeline); a mode with
several ranks runs on rank processes (`RankPool`). Both batch requests step by step. A rank of a
torchrun launch (the LightX2V facade's way) runs its own rank in the caller's thread
(`InProcessEngine`): torchrun, not the engine, starts the other ranks.
"""

from __future__ import annotations

import torch

from ..model.checkpoint_config import CheckpointConfig
from ..parallel.parallel_pipeline import check_heads
from ..sampling.pipeline import NeoPPPipeline, set_threads
from ..sampling.plan import RequestRules
from .batch_engine import BatchingEngine
from .engine import Engine, EngineHooks
from .in_process import InProcessEngine
from .intra_op import fastest_threads
from .rank_pool import RankPool
from .spec import EngineSpec
from .warmup import warm_up_request


def build_engine(spec: EngineSpec, hooks: EngineHooks | None = None) -> Engine:
    """The engine of ``spec.mode`` on ``spec.checkpoint``, one device per rank (``spec.devices``)."""
    if spec.torchrun_rank:
        from ..parallel.torchrun import rank_pipeline

        return InProcessEngine(rank_pipeline(spec.checkpoint, spec.mode, spec.devices[0], spec.dtype))
    set_threads(spec.threads)
    if spec.mode.world_size == 1:
        pipe = NeoPPPipeline.from_pretrained(spec.checkpoint, spec.mode, spec.devices[0], spec.dtype, spec.limits,
                                             speed=spec.speed)
        pipe.use_adapter_dir(spec.lora_dir, spec.lora_max_bytes)
        timings = None
        if spec.measure_threads and pipe.device.type == "cpu":
            probe = warm_up_request(pipe, spec.mode)
            _, timings = fastest_threads(lambda: pipe.generate(probe), spec.threads or torch.get_num_threads())
        engine = BatchingEngine(pipe, spec.token_budget, hooks, spec.max_queued, spec.patience)
        engine.thread_timings = timings
        return engine
    config = CheckpointConfig.from_checkpoint(spec.checkpoint)
    check_heads(config, spec.mode)
    return RankPool(spec, RequestRules(config, spec.limits), hooks)
