"""The one engine interface: generate an image for a request, step by step, cancellable.

Every serving path calls an :class:`Engine`. There are three kinds, built by
``neopp.engines.factory.build_engine``: the pipeline in this process, one request at a time
(``InProcessEngine``); the same on rank processes (``neopp.engines.rank_pool.WorkerPool``); and
step batching, which runs many requests in one batched step (``BatchingEngine`` in this
process, ``neopp.engines.rank_stream_pool.StreamPool`` on ranks). Each offers both calls:
``submit`` reports every step as a :class:`StepEvent` (a batching engine queues the request and
returns at once; the others run it in the caller's thread), and ``generate`` blocks until the
pixels. An engine implements one of the two; ``submit_in_caller`` and ``generate_by_waiting``
give it the other, so the two calls cannot drift apart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..errors import GenerationCancelled, WorkerFailure
from ..model.checkpoint_config import CheckpointConfig
from ..modes import ModeSpec
from ..request import GenerationRequest
from ..sampling.pipeline import StepFn, StopFn
from ..sampling.plan import RequestRules
from ..sampling.sampler import StepEvent

log = logging.getLogger(__name__)


EmitFn = Callable[[StepEvent], None]
CancelledFn = Callable[[], bool]


class Engine(Protocol):
    """Runs requests (already validated, noise drawn) of one mode on one checkpoint."""

    config: CheckpointConfig
    mode: ModeSpec
    rules: RequestRules
    dtype: torch.dtype

    def validate(self, req: GenerationRequest) -> None:
        """Every rule the request can break, before any heavy work (``RequestRules``)."""
        ...

    def submit(self, req: GenerationRequest, emit: EmitFn, cancelled: CancelledFn, preview_every: int = 0) -> None:
        """Run ``req``, reporting through ``emit``; ``cancelled`` is polled at step boundaries;
        every request gets exactly one last event (its pixels or its error)."""
        ...

    def generate(self, req: GenerationRequest, should_stop: StopFn | None = None,
                 on_step: StepFn | None = None) -> np.ndarray:
        """The final uint8 pixels [H, W, 3]; raises the request's error."""
        ...

    def close(self) -> None:
        """Stop: queued and running requests end with a cancellation."""
        ...


def submit_in_caller(generate: Callable[..., np.ndarray], req: GenerationRequest, emit: EmitFn,
                     cancelled: CancelledFn) -> None:
    """``submit`` of an engine that runs a request in the caller's thread: its ``generate``,
    reported as events (no previews: those come from the batching engines)."""
    total = req.sampling.infer_steps
    last = [0.0]

    def on_step(k: int, seconds: float) -> None:
        last[0] = seconds
        if k + 1 < total:  # the last step is reported with the pixels
            emit(StepEvent(k + 1, total, seconds=seconds))

    try:
        pixels = generate(req, should_stop=cancelled, on_step=on_step)
    except Exception as exc:  # noqa: BLE001 - the request ends with its error, the engine goes on
        emit(StepEvent(0, total, error=exc))
        return
    emit(StepEvent(total, total, final=pixels, seconds=last[0]))


class QueuedEngine:
    """``generate`` for an engine that queues (a step batcher): ``submit``, then wait for the last
    event, at most ``wait_s``."""

    wait_s = 3600.0
    submit: Callable[..., None]

    def generate(self, req: GenerationRequest, should_stop: StopFn | None = None,
                 on_step: StepFn | None = None) -> np.ndarray:
        return generate_by_waiting(self.submit, req, should_stop, on_step, self.wait_s)


def generate_by_waiting(submit: Callable[..., None], req: GenerationRequest, should_stop: StopFn | None,
                        on_step: StepFn | None, timeout_s: float) -> np.ndarray:
    """``generate`` of an engine that queues: submit, then wait for the last event. ``on_step``
    runs on the engine's thread."""
    done, last = threading.Event(), []

    def emit(event: StepEvent) -> None:
        if event.last:
            last.append(event)
            done.set()
        elif on_step is not None:
            on_step(event.step - 1, event.seconds)

    gave_up = threading.Event()
    submit(req, emit, lambda: gave_up.is_set() or (should_stop is not None and should_stop()))
    if not done.wait(timeout_s):
        gave_up.set()  # the engine drops it at its next step boundary
        raise WorkerFailure(f"the request got no answer within {timeout_s:.0f} s")
    if last[0].error is not None:
        raise last[0].error
    return last[0].final

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
