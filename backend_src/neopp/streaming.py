"""What a streaming generation reports, and the engine interface the streaming models call.

A streaming request reports progress after every denoising step (optionally with a preview:
the current clean-image prediction as pixels) and ends with the final pixels or an error.
Engines run several requests at once, batched step by step; the serving layer only submits
requests and forwards events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .pipeline import GenerationRequest


@dataclass
class StepEvent:
    """One report of one request: ``step`` steps of ``total`` are done.

    ``preview`` (uint8 [H, W, 3], full size) is set on the steps the request asked a preview
    for; ``final`` (uint8 [H, W, 3]) on the last event; ``error`` ends a request that failed or
    was cancelled (then nothing else follows).
    """

    step: int
    total: int
    preview: np.ndarray | None = None
    final: np.ndarray | None = None
    error: Exception | None = None

    @property
    def last(self) -> bool:
        return self.final is not None or self.error is not None


EmitFn = Callable[[StepEvent], None]
CancelledFn = Callable[[], bool]


class StreamEngine(Protocol):
    """Runs submitted requests to completion, reporting through ``emit`` from its own thread."""

    def submit(self, req: GenerationRequest, emit: EmitFn, cancelled: CancelledFn, preview_every: int = 0) -> None:
        """Queue ``req`` (already validated, noise drawn) and return at once; ``cancelled`` is
        polled at step boundaries; every request gets exactly one last event."""
        ...

    def close(self) -> None:
        """Stop: queued and running requests end with a cancellation error event."""
        ...
