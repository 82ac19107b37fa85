"""`BatchingEngine`: an `Engine` that runs many requests at once, batched step by step.

A scheduler thread owns the active set. At each step boundary it drops cancelled requests
(with a `GenerationCancelled` event), admits queued ones in arrival order while the token
budget allows, runs one batched step and lets finished or failed requests leave. A request
bigger than the whole budget still runs, alone, so no size starves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from ..errors import GenerationCancelled
from ..request import GenerationRequest
from ..sampling.batching import Active, StepBatcher, fits, start, step_cost
from ..sampling.pipeline import NeoPPPipeline
from .engine import (
    DEFAULT_TOKEN_BUDGET,
    CancelledFn,
    EmitFn,
    EngineHooks,
    QueuedEngine,
    StepEvent,
    Ticket,
    TicketOffice,
    is_cancelled,
    send,
)
from .in_process import InProcessEngine

log = logging.getLogger(__name__)


class BatchingEngine(QueuedEngine, InProcessEngine):
    """Single-process step batcher behind a scheduler thread (the pipeline's face is inherited)."""

    def __init__(self, pipe: NeoPPPipeline, token_budget: int = DEFAULT_TOKEN_BUDGET,
                 hooks: EngineHooks | None = None) -> None:
        if token_budget < 1:
            raise ValueError(f"token_budget: must be positive, got {token_budget}")
        super().__init__(pipe)
        self.token_budget, self.hooks = token_budget, hooks or EngineHooks()
        self.batcher = StepBatcher(pipe)
        self._cv = threading.Condition()
        self._queue: deque[Ticket] = deque()
        self._closed = False
        self._tickets = TicketOffice()
        self._thread = threading.Thread(target=self._loop, name="neopp-batching", daemon=True)
        self._thread.start()

    def submit(self, req: GenerationRequest, emit: EmitFn, cancelled: CancelledFn, preview_every: int = 0) -> None:
        with self._cv:
            ticket = self._tickets.issue(req, emit, cancelled, preview_every)
            if not self._closed:
                self._queue.append(ticket)
                self._cv.notify()
                return
        TicketOffice.closed(ticket)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()
        self.pipe.close()  # what the requests still running held (their graphs)

    # ---- the scheduler -------------------------------------------------------------------
    def _loop(self) -> None:
        active: list[tuple[Ticket, Active]] = []
        waiting: tuple[Ticket, Active] | None = None  # prepared head of the queue that did not fit
        while True:
            with self._cv:
                while not self._closed and not self._queue and not active and waiting is None:
                    self._cv.wait()
                if self._closed:
                    queued, self._queue = list(self._queue), deque()
                    break
            active = self._without_cancelled(active)
            if waiting is not None and self._dropped(waiting[0], 0, waiting[1].total):
                waiting = None
            self._drop_queued()
            waiting = self._admit(active, waiting)
            if active:
                active = self._step(active)
        leaving = [(t, a.k) for t, a in active] + [(t, 0) for t in ([waiting[0]] if waiting else []) + queued]
        for ticket, done in leaving:
            send(ticket, StepEvent(done, ticket.req.sampling.infer_steps,
                                   error=GenerationCancelled("the engine closed before the request finished")))

    def _without_cancelled(self, active: list[tuple[Ticket, Active]]) -> list[tuple[Ticket, Active]]:
        kept = []
        for ticket, a in active:
            if self._dropped(ticket, a.k, a.total):
                self.pipe.release(a.prep)
            else:
                kept.append((ticket, a))
        return kept

    def _dropped(self, ticket: Ticket, k: int, total: int) -> bool:
        if not is_cancelled(ticket):
            return False
        send(ticket, StepEvent(k, total, error=GenerationCancelled(f"cancelled before step {k + 1} of {total}")))
        return True

    def _drop_queued(self) -> None:
        """Queued requests are polled too, so a cancelled one does not wait for its turn to leave."""
        with self._cv:
            queued = list(self._queue)
        gone = {t.job for t in queued if self._dropped(t, 0, t.req.sampling.infer_steps)}
        if gone:
            with self._cv:
                self._queue = deque(t for t in self._queue if t.job not in gone)

    def _admit(self, active: list[tuple[Ticket, Active]],
               waiting: tuple[Ticket, Active] | None) -> tuple[Ticket, Active] | None:
        """Admit in arrival order while the budget allows; return the prepared head that waits."""
        used = sum(step_cost(self.pipe, a) for _, a in active)
        while True:
            if waiting is None:
                waiting = self._next_prepared()
                if waiting is None:
                    return None
            cost = step_cost(self.pipe, waiting[1])
            if not fits(used, cost, self.token_budget, alone=not active):
                return waiting
            self.hooks.call("queue_wait", time.monotonic() - waiting[0].submitted)
            active.append(waiting)
            used += cost
            waiting = None

    def _next_prepared(self) -> tuple[Ticket, Active] | None:
        while True:
            with self._cv:
                if not self._queue:
                    return None
                ticket = self._queue.popleft()
            total = ticket.req.sampling.infer_steps
            if self._dropped(ticket, 0, total):
                continue
            try:
                return ticket, start(self.pipe, ticket.job, ticket.req, ticket.preview_every, ticket.submitted)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory preparing it: this request fails alone
                send(ticket, StepEvent(0, total, error=exc))

    def _step(self, active: list[tuple[Ticket, Active]]) -> list[tuple[Ticket, Active]]:
        began = time.perf_counter()
        try:
            events = self.batcher.step([a for _, a in active])
        except Exception as exc:  # noqa: BLE001 - a failure of the shared pass fails its batch only
            log.exception("batched step failed")
            for ticket, a in active:
                send(ticket, StepEvent(a.k, a.total, error=exc))
                self.pipe.release(a.prep)
            return []
        self.hooks.call("step_seconds", time.perf_counter() - began)
        self.hooks.call("batch_size", len(active))
        staying = []
        for (ticket, a), ev in zip(active, events):
            if send(ticket, ev) and not ev.last:
                staying.append((ticket, a))
            else:
                self.pipe.release(a.prep)
        return staying
