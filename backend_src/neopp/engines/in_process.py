"""`InProcessEngine`: one pipeline in the caller's thread, one request at a time.

What a rank launched by torchrun runs (the LightX2V facade): every rank calls ``generate`` with
the same request at the same time and the pipeline's collectives keep them in step, so there is
no queue and no thread; ``submit`` reports the steps as they happen. Serving runs step-batching
engines instead (``BatchingEngine``, ``RankPool``).
"""

from __future__ import annotations

import numpy as np
import torch

from ..model.checkpoint_config import CheckpointConfig
from ..modes import ModeSpec
from ..request import GenerationRequest
from ..sampling.pipeline import NeoPPPipeline, StepFn, StopFn
from ..sampling.plan import RequestRules
from .engine import CancelledFn, EmitFn, submit_in_caller


class InProcessEngine:
    """An `Engine` over one pipeline (a rank's, under torchrun, runs its collectives here too)."""

    def __init__(self, pipe: NeoPPPipeline) -> None:
        self.pipe = pipe

    @property
    def config(self) -> CheckpointConfig:
        return self.pipe.config

    @property
    def mode(self) -> ModeSpec:
        return self.pipe.mode

    @property
    def rules(self) -> RequestRules:
        return self.pipe.rules

    @property
    def device(self) -> torch.device:
        return self.pipe.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pipe.dtype

    def validate(self, req: GenerationRequest) -> None:
        self.pipe.validate(req)

    def generate(self, req: GenerationRequest, should_stop: StopFn | None = None,
                 on_step: StepFn | None = None) -> np.ndarray:
        return self.pipe.generate(req, should_stop, on_step)

    def submit(self, req: GenerationRequest, emit: EmitFn, cancelled: CancelledFn, preview_every: int = 0) -> None:
        submit_in_caller(self.generate, req, emit, cancelled)

    def close(self) -> None:
        self.pipe.close()
