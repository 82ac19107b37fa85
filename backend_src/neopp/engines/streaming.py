"""What a streaming generation reports, and the engine interface the streaming models call.

A streaming request reports progress after every denoising step (optionally with a preview:
the current clean-image prediction as pixels) and ends with the final pixels or an error.
Engines run several requests at once, batched step by step; the serving layer only submits
requests and forwards events.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import GenerationCancelled
from ..request import GenerationRequest

log = logging.getLogger(__name__)


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

# Tokens x branches one step may carry: 8 guided 512x512 requests (1024 tokens each, 2 branches).
DEFAULT_TOKEN_BUDGET = 16384


@dataclass
class EngineHooks:
    """Optional metrics callbacks (the serving layer feeds histograms with them)."""

    queue_wait: Callable[[float], None] | None = None   # seconds from submit to joining a batch
    batch_size: Callable[[int], None] | None = None     # requests in one step
    step_seconds: Callable[[float], None] | None = None  # wall time of one batched step

    def call(self, name: str, value: float) -> None:
        hook = getattr(self, name)
        if hook is not None:
            try:
                hook(value)
            except Exception:  # noqa: BLE001 - a broken metric must not stop generation
                log.exception("metrics hook %s failed", name)


@dataclass
class Ticket:
    """A submitted request with the callbacks that report it."""

    job: int
    req: GenerationRequest
    emit: EmitFn
    cancelled: CancelledFn
    preview_every: int
    submitted: float


class TicketOffice:
    """Numbers the requests an engine takes, and answers the ones that come after it closed."""

    def __init__(self) -> None:
        self.jobs = 0

    def issue(self, req: GenerationRequest, emit: EmitFn, cancelled: CancelledFn, preview_every: int) -> Ticket:
        self.jobs += 1
        return Ticket(self.jobs, req, emit, cancelled, preview_every, time.monotonic())

    @staticmethod
    def closed(ticket: Ticket) -> None:
        send(ticket, StepEvent(0, ticket.req.sampling.infer_steps, error=GenerationCancelled("the engine is closed")))


def send(ticket: Ticket, event: StepEvent) -> bool:
    """Emit one event; False when the caller's emit failed (the request is then dropped)."""
    try:
        ticket.emit(event)
        return True
    except Exception:  # noqa: BLE001 - one caller's failure must not stop the others
        log.exception("emit failed for streaming request %d; dropping it", ticket.job)
        return False


def is_cancelled(ticket: Ticket) -> bool:
    try:
        return bool(ticket.cancelled())
    except Exception:  # noqa: BLE001 - a failing probe counts as a cancellation
        log.exception("cancelled() failed for streaming request %d", ticket.job)
        return True
