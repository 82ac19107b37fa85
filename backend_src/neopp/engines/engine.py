"""The one engine interface: generate an image for a request, step by step, cancellable.

Every serving path calls an :class:`Engine`, built by ``neopp.engines.factory.build_engine``
from an :class:`~neopp.engines.spec.EngineSpec`. A mode runs on a step-batching engine:
``BatchingEngine`` in this process, ``RankPool`` on rank processes; both queue a request and
run it with whatever else is running, one batched step at a time (the loop and its scheduler
are written once, ``step_loop`` and ``scheduler``). ``TritonEngine`` runs a request on a Triton
server instead. Each offers both calls: ``submit`` reports every step as a ``StepEvent`` and
returns (a queueing engine at once), ``generate`` blocks until the pixels. A queueing engine
implements ``submit`` and takes ``generate`` from :class:`QueuedEngine`; the remote one the
reverse (``submit_in_caller``), so the two calls cannot drift apart.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..contract.statuses import QUEUE_FULL_TEXT
from ..errors import GenerationCancelled, QueueFull, WorkerFailure
from ..model.checkpoint_config import CheckpointConfig
from ..modes import ModeSpec
from ..request import GenerationRequest
from ..sampling.pipeline import NeoPPPipeline, StepFn, StopFn
from ..sampling.plan import RequestRules
from ..sampling.sampler import StepEvent
from .step_loop import Entry

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
    total = req.sampling_params.infer_steps
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


class PipelineFacts:
    """What an engine over one local pipeline answers from that pipeline: its checkpoint, mode,
    rules, device and dtype, and the validation of a request."""

    pipe: NeoPPPipeline

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


@dataclass(eq=False)
class Ticket:
    """A submitted request with the callbacks that report it."""

    job: int
    entry: Entry
    emit: EmitFn
    cancelled: CancelledFn

    @property
    def req(self) -> GenerationRequest:
        return self.entry.req

    def end(self, error: Exception, done: int = 0) -> None:
        """The request's last event: ``error`` after ``done`` steps."""
        send(self, StepEvent(done, self.req.sampling_params.infer_steps, error=error))


def send(ticket: Ticket, event: StepEvent) -> bool:
    """Emit one event; False when the caller's emit failed (the request is then dropped)."""
    try:
        ticket.emit(event)
        return True
    except Exception:  # noqa: BLE001 - one caller's failure must not stop the others
        log.exception("emit failed for request %d; dropping it", ticket.job)
        return False


def is_cancelled(ticket: Ticket) -> bool:
    try:
        return bool(ticket.cancelled())
    except Exception:  # noqa: BLE001 - a failing probe counts as a cancellation
        log.exception("cancelled() failed for request %d", ticket.job)
        return True


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


class QueuedEngine:
    """What the step-batching engines share: numbered tickets, the bound on waiting requests, and
    ``generate`` as ``submit`` then a wait for the last event (at most ``wait_s``)."""

    wait_s = 3600.0
    max_queued = 0  # requests waiting to start; 0: no bound
    submit: Callable[..., None]

    def __init__(self) -> None:
        self._numbers = itertools.count(1)

    def _ticket(self, req: GenerationRequest, emit: EmitFn, cancelled: CancelledFn, preview_every: int) -> Ticket:
        return Ticket(next(self._numbers), Entry(req, preview_every, time.monotonic()), emit, cancelled)

    def _refuse_if_full(self, ticket: Ticket, waiting: int) -> bool:
        """End ``ticket`` with ``QueueFull`` when ``waiting`` requests already wait to start."""
        if self.max_queued and waiting >= self.max_queued:
            ticket.end(QueueFull(f"{QUEUE_FULL_TEXT}: {waiting} requests already wait for this engine "
                                 f"(max_queued {self.max_queued}); retry later"))
            return True
        return False

    def generate(self, req: GenerationRequest, should_stop: StopFn | None = None,
                 on_step: StepFn | None = None) -> np.ndarray:
        return generate_by_waiting(self.submit, req, should_stop, on_step, self.wait_s)


def generate_by_waiting(submit: Callable[..., None], req: GenerationRequest, should_stop: StopFn | None,
                        on_step: StepFn | None, timeout_s: float) -> np.ndarray:
    """``generate`` of an engine that queues: submit, then wait for the last event. ``on_step``
    runs on the engine's thread; if it raises, the request ends with that error."""
    done, last = threading.Event(), []
    gave_up = threading.Event()

    def emit(event: StepEvent) -> None:
        if event.last:
            last.append(event)
            done.set()
        elif on_step is not None:
            try:
                on_step(event.step - 1, event.seconds)
            except Exception as exc:  # noqa: BLE001 - the caller's hook ends its own request
                last.append(StepEvent(event.step, event.total, error=exc))
                gave_up.set()
                done.set()

    submit(req, emit, lambda: gave_up.is_set() or (should_stop is not None and should_stop()))
    if not done.wait(timeout_s):
        gave_up.set()  # the engine drops it at its next step boundary
        raise WorkerFailure(f"the request got no answer within {timeout_s:.0f} s")
    if last[0].error is not None:
        raise last[0].error
    return last[0].final


def closed_error() -> GenerationCancelled:
    return GenerationCancelled("the engine is closed")
