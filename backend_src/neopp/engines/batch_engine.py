"""`BatchingEngine`: the step-batching `Engine` of a one-process mode.

A loop thread owns the running batch. ``submit`` queues a request and returns; at each step
boundary the thread polls cancellations, asks the scheduler what joins and what leaves, runs
one batched step and reports every request's event. Everything of the loop but its thread is
``StepLoop``'s and ``Scheduler``'s, which a rank pool's rank 0 drives the same way.

A request's own failure ends that request (``StepLoop``); a failure of the loop itself (a bug
outside any one request) stops the loop: every request it held, and every later one, ends with
``EngineDown`` (UNAVAILABLE, retry), and ``failure`` says why, which the engine's host publishes
so the model is taken out of service and replaced.
"""

from __future__ import annotations

import logging
import threading

import torch

from ..errors import EngineDown
from ..request import GenerationRequest
from ..sampling.batching import StepBatcher
from ..sampling.pipeline import NeoPPPipeline
from ..sampling.sampler import StepEvent
from .adapter_loader import AdapterLoader
from .engine import (
    CancelledFn,
    EmitFn,
    EngineHooks,
    PipelineFacts,
    QueuedEngine,
    Ticket,
    closed_error,
    is_cancelled,
    send,
)
from .fault_point import FaultPoint
from .intra_op import own_threads
from .scheduler import Scheduler
from .spec import DEFAULT_MAX_QUEUED, DEFAULT_TOKEN_BUDGET
from .step_loop import StepLoop

log = logging.getLogger(__name__)


class BatchingEngine(PipelineFacts, QueuedEngine):
    """One pipeline, many requests: every running request advances one step per batched pass."""

    def __init__(self, pipe: NeoPPPipeline, token_budget: int = DEFAULT_TOKEN_BUDGET,
                 hooks: EngineHooks | None = None, max_queued: int = DEFAULT_MAX_QUEUED,
                 patience: int | None = None) -> None:
        super().__init__()
        self.pipe, self.hooks, self.max_queued = pipe, hooks or EngineHooks(), max_queued
        self.scheduler = Scheduler(token_budget) if patience is None else Scheduler(token_budget, patience)
        self.loop = StepLoop(pipe, StepBatcher(pipe), self._report)
        self._cv = threading.Condition()
        self._incoming: list[Ticket] = []
        self._tickets: dict[int, Ticket] = {}  # every request the loop holds, queued or running
        self._closed = False
        self._failure: str | None = None  # why the loop stopped, once it has
        self._fault = FaultPoint()
        self.loader = AdapterLoader(lambda: self.pipe.adapters, self._enqueue)
        self.threads = torch.get_num_threads()  # the step thread's, whatever the process sets later
        self.thread_timings: dict[int, float] | None = None  # a probe step's seconds per count, where measured
        threads_set = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(threads_set,), name="neopp-batching", daemon=True)
        self._thread.start()
        threads_set.wait()

    # ---- the Engine face (the pipeline's facts come from PipelineFacts) ----------------------
    @property
    def failure(self) -> str | None:
        """Why this engine can serve no more (its loop failed or its thread is gone), else None."""
        if self._failure is None and not self._thread.is_alive() and not self._closed:
            return "the engine's loop thread ended"
        return self._failure

    def submit(self, req: GenerationRequest, emit: EmitFn, cancelled: CancelledFn, preview_every: int = 0) -> None:
        ticket = self._ticket(req, emit, cancelled, preview_every)
        if req.lora is not None and req.adapter is None:
            with self._cv:
                if self._refuse_if_full(ticket, len(self._incoming) + self.scheduler.waiting + self.loader.waiting):
                    return
            self.loader.submit(ticket)  # its adapter is read off the step thread, then it joins the queue
            return
        self._enqueue(ticket)

    def _enqueue(self, ticket: Ticket) -> None:
        with self._cv:
            if self._closed:
                ticket.end(closed_error())
                return
            if self._failure is not None:
                ticket.end(EngineDown(self._failure))
                return
            if self._refuse_if_full(ticket, len(self._incoming) + self.scheduler.waiting):
                return
            self._incoming.append(ticket)
            self._cv.notify()

    def close(self) -> None:
        self.loader.close()
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()
        self.pipe.close()  # what the requests still running held (their graphs)

    # ---- the loop thread -----------------------------------------------------------------
    def _report(self, job: int, event: StepEvent) -> bool:
        ticket = self._tickets.get(job)
        if ticket is None:
            return False
        ok = send(ticket, event)
        if event.last or not ok:
            del self._tickets[job]
        return ok

    def _take_incoming(self) -> bool:
        """Wait while idle; move new requests to the scheduler. False once the engine closes."""
        with self._cv:
            while not self._closed and not self._incoming and not self._tickets:
                self._cv.wait()
            if self._closed:
                return False
            incoming, self._incoming = self._incoming, []
        for ticket in incoming:
            self._tickets[ticket.job] = ticket
            self.scheduler.enqueue(ticket.job, ticket.req.lane)
        return True

    def _run(self, threads_set: threading.Event) -> None:
        try:
            try:
                own_threads(self.threads)
            finally:
                threads_set.set()  # the constructor goes on either way; a failure is the loop's
            while self._take_incoming():
                self._fault.check()
                self._pass()
        except BaseException as exc:  # noqa: BLE001 - the loop itself failed (even by SystemExit): out of
            self._fail_loop(exc)  # service, and nothing it held is left waiting; the thread ends here
            return
        self._stop_all()

    def _pass(self) -> None:
        """One step boundary: cancellations, the scheduler's decision, one batched step."""
        for job, ticket in list(self._tickets.items()):
            if is_cancelled(ticket):
                self.scheduler.cancel(job)
        entries = {job: t.entry for job, t in self._tickets.items()}
        decision = self.loop.decide(self.scheduler, entries)
        for wait in self.loop.apply(decision, entries.__getitem__, self._tickets.get):
            self.hooks.call("queue_wait", wait)
        if self.loop.active:
            self._step()

    def _stop_all(self) -> None:
        """Closed: what is queued or running ends with a cancellation."""
        with self._cv:
            incoming, self._incoming = self._incoming, []
        self._tickets.update((t.job, t) for t in incoming)
        running = set(self.loop.jobs)
        queued = [(job, t.entry) for job, t in self._tickets.items() if job not in running]
        self.loop.stop(queued, "the engine closed before the request finished")

    def _fail_loop(self, exc: BaseException) -> None:
        """Every request held or arriving ends with ``EngineDown``; the state is not trusted again."""
        log.error("the engine's loop failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        with self._cv:
            self._failure = f"the engine's loop stopped ({type(exc).__name__}); retry the request"
            incoming, self._incoming = self._incoming, []
        held = {**self._tickets, **{t.job: t for t in incoming}}
        self._tickets = {}
        for ticket in held.values():
            ticket.end(EngineDown(self._failure))
        for a in self.loop.active:
            try:
                self.pipe.release(a.prep)
            except Exception:  # noqa: BLE001 - what is left is freed with the process
                log.exception("could not release request %d", a.job)
        self.loop.active = []

    def _step(self) -> None:
        try:
            stats = self.loop.step()
        except Exception as exc:  # noqa: BLE001 - a failure of the shared pass fails its batch only
            log.exception("batched step failed")
            self.loop.fail_all(exc)
            return
        self.hooks.call("step_seconds", stats.seconds)
        self.hooks.call("batch_size", stats.batch)
