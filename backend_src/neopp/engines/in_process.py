"""`InProcessEngine`: one pipeline in the caller's thread, one request at a time.

What a rank launched by torchrun runs (the LightX2V facade): every rank calls ``generate`` with
the same request at the same time and the pipeline's collectives keep them in step, so there is
no queue and no thread; ``submit`` reports the steps as they happen. Serving runs step-batching
engines instead (``BatchingEngine``, ``RankPool``).
"""

from __future__ import annotations

import numpy as np

from ..request import GenerationRequest
from ..sampling.pipeline import NeoPPPipeline, StepFn, StopFn
from .engine import CancelledFn, EmitFn, PipelineFacts, submit_in_caller


class InProcessEngine(PipelineFacts):
    """An `Engine` over one pipeline (a rank's, under torchrun, runs its collectives here too)."""

    def __init__(self, pipe: NeoPPPipeline) -> None:
        self.pipe = pipe

    def generate(self, req: GenerationRequest, should_stop: StopFn | None = None,
                 on_step: StepFn | None = None) -> np.ndarray:
        return self.pipe.generate(req, should_stop, on_step)

    def submit(self, req: GenerationRequest, emit: EmitFn, cancelled: CancelledFn, preview_every: int = 0) -> None:
        submit_in_caller(self.generate, req, emit, cancelled)

    def close(self) -> None:
        self.pipe.close()
