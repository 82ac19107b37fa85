"""`StreamPool`: the parent side of the batched rank loop (a step-batching `Engine`).

`submit` hands a request to every rank and returns; a pump thread polls cancellations (sent
to rank 0, which decides at the next step boundary), turns rank 0's reports into events and
metrics, and fails every live request with `WorkerFailure` when a rank dies or falls silent
(the pool is then rebuilt as `WorkerPool` does).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from ..errors import GenerationCancelled, WorkerFailure
from ..request import GenerationRequest
from ..sampling.plan import RequestRules
from . import engine as eng
from .lifeline import silent_rank
from .rank_loop import ERRORS, StreamPoolSpec, _stream_rank_main
from .rank_pool import POLL_S, SILENCE_CHECK_S, WorkerPool

CLOSE_WAIT_S = 10.0


class StreamPool(eng.QueuedEngine, WorkerPool):
    """Rank processes running the batched loop; rank 0's events reach ``emit`` here."""

    worker_main = staticmethod(_stream_rank_main)

    @property
    def wait_s(self) -> float:
        """How long `generate` waits for its request: as long as the plain pool waits for one."""
        return 10 * self.spec.collective_timeout_s

    def __init__(self, spec: StreamPoolSpec, rules: RequestRules, hooks: eng.EngineHooks | None = None) -> None:
        super().__init__(spec, rules)
        self.hooks = hooks or eng.EngineHooks()
        self._tickets: dict[int, eng.Ticket] = {}
        self._office = eng.TicketOffice()
        self._told: set[int] = set()      # cancellations already sent to rank 0
        self._closing = False
        self._rank0_closed = threading.Event()
        self._pump_thread = threading.Thread(target=self._pump, name="neopp-stream-pump", daemon=True)
        self._pump_thread.start()

    def submit(self, req: GenerationRequest, emit: eng.EmitFn, cancelled: eng.CancelledFn,
               preview_every: int = 0) -> None:
        with self._lock:
            ticket = self._office.issue(req, emit, cancelled, preview_every)
            if self._closing:
                eng.TicketOffice.closed(ticket)
                return
            self._ensure_healthy()
            self._tickets[ticket.job] = ticket
            for rank, q in enumerate(self._tasks):
                q.put(("req", ticket.job, self._rank_request(req, rank), preview_every, ticket.submitted))

    def close(self) -> None:
        with self._lock:
            self._closing = True
            for q in self._tasks:
                q.put(None)
        self._rank0_closed.wait(CLOSE_WAIT_S)
        self._pump_thread.join(CLOSE_WAIT_S)
        super().close()
        self._fail_all(GenerationCancelled("the engine closed before the request finished"))

    # ---- the pump ----------------------------------------------------------------------------
    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            tickets, self._tickets = list(self._tickets.values()), {}
        for ticket in tickets:
            eng.send(ticket, eng.StepEvent(0, ticket.req.sampling.infer_steps, error=exc))

    def _poll_cancels(self) -> None:
        with self._lock:
            tickets = [t for t in self._tickets.values() if t.job not in self._told]
        for ticket in tickets:
            if eng.is_cancelled(ticket):
                self._told.add(ticket.job)
                with self._lock:
                    if self._tasks:
                        self._tasks[0].put(("cancel", ticket.job))

    def _pump(self) -> None:
        next_check = time.monotonic() + SILENCE_CHECK_S
        while not self._rank0_closed.is_set():
            self._poll_cancels()
            results = self._results
            try:
                kind, job, info = results.get(timeout=POLL_S) if results is not None else (None, 0, None)
            except (queue.Empty, OSError, ValueError):
                kind = None
            if kind is None:
                if self._closing or self._rebuild is not None:
                    continue
                notice = self._death_notice(wait_s=0)
                if notice is None and time.monotonic() > next_check:
                    next_check = time.monotonic() + SILENCE_CHECK_S
                    notice = silent_rank(self.pids(), self._beats, self.spec.silence_s) if self._tickets else None
                if notice:
                    self._fail_all(self._fail_and_rebuild(notice))
                continue
            self._handle(kind, job, info)

    def _handle(self, kind: str, job: int, info: Any) -> None:
        if kind == "event":
            step, total, preview, final, err_kind, message = info
            error = None if err_kind is None else ERRORS.get(err_kind, WorkerFailure)(message)
            ticket = self._tickets.get(job)
            if ticket is None:
                return
            ok = eng.send(ticket, eng.StepEvent(step, total, preview=preview, final=final, error=error))
            if not ok or final is not None or error is not None:
                with self._lock:
                    self._tickets.pop(job, None)
                    self._told.discard(job)
                if not ok:  # the caller is gone: stop computing for it
                    self._told.add(job)
                    self._tasks[0].put(("cancel", job))
        elif kind == "metrics":
            waits, size, seconds = info
            for wait in waits:
                self.hooks.call("queue_wait", wait)
            self.hooks.call("batch_size", size)
            self.hooks.call("step_seconds", seconds)
        elif kind == "closed":
            self._rank0_closed.set()
        elif kind == "error" and not self._closing:
            self._fail_all(self._fail_and_rebuild(self._death_notice() or f"generation failed in {info}"))

