"""`RankPool`: the step-batching `Engine` of a multi-rank mode (CFG-parallel, Ulysses).

The instance (a Triton model or any caller) keeps one pool. Each rank is a spawned process
holding the weights and a torch.distributed group, running ``rank_loop.rank_main``. ``submit``
hands a request to every rank (only the KV its branches need) and returns; a pump thread
forwards cancellations to rank 0 (which decides at the next step boundary) and turns rank 0's
reports into events and metrics. A dead, silent or failing rank fails every live request with
`WorkerFailure`; the ranks are then restarted for the next request.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import threading
import time
from typing import Any

import torch
import torch.multiprocessing as tmp

from ..errors import ConfigError, EngineDown, GenerationCancelled, WorkerFailure
from ..model.checkpoint import default_dtype
from ..model.checkpoint_config import CheckpointConfig
from ..parallel.rank_step import rank_request
from ..request import GenerationRequest
from ..sampling.plan import RequestRules, check_cache
from ..sampling.sampler import StepEvent
from .engine import CancelledFn, EmitFn, EngineHooks, QueuedEngine, Ticket, closed_error, is_cancelled, send
from .lifeline import silent_rank, start_processes
from .rank_loop import ERRORS, rank_main
from .spec import EngineSpec

POLL_S = 0.02
SILENCE_CHECK_S = 0.2
CLOSE_WAIT_S = 10.0

log = logging.getLogger(__name__)


def _close_and_flush(q: Any) -> None:
    q.close()
    q.join_thread()


class RankPool(QueuedEngine):
    """Rank processes running the batched loop; rank 0's events reach ``emit`` here."""

    def __init__(self, spec: EngineSpec, rules: RequestRules, hooks: EngineHooks | None = None) -> None:
        super().__init__()
        self.spec, self.mode, self.rules = spec, spec.mode, rules  # the instance checks requests itself
        self.config: CheckpointConfig = rules.config
        self.device = ",".join(spec.devices)
        self.dtype = spec.dtype or default_dtype(torch.device(spec.devices[0]))
        self.max_queued, self.hooks = spec.max_queued, hooks or EngineHooks()
        self.wait_s = 10 * spec.collective_timeout_s  # how long `generate` waits for its request
        self._ctx = tmp.get_context("spawn")
        self._lock = threading.Lock()
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._rebuild: threading.Thread | None = None
        self._starting = threading.Event()
        self._tickets: dict[int, Ticket] = {}
        self._started: set[int] = set()  # jobs rank 0 has reported a step of
        self._replay: list[Ticket] = []  # not started when the ranks failed: sent again to the new ranks
        self._told: set[int] = set()     # cancellations already sent to rank 0
        self._closing = False
        self.comm_seconds = 0.0  # rank 0's time inside collectives, all steps so far
        self._rank0_closed = threading.Event()
        self._start()
        self._pump_thread = threading.Thread(target=self._pump, name="neopp-rank-pump", daemon=True)
        self._pump_thread.start()

    # ---- lifecycle ----------------------------------------------------------------------
    def _start(self) -> None:
        """Start the ranks and wait until each has loaded (the pump stays off their queue meanwhile)."""
        self._starting.set()
        try:
            self._start_ranks()
        finally:
            self._starting.clear()

    def _start_ranks(self) -> None:
        world = self.spec.mode.world_size
        # Rank 0 binds the rendezvous store on a port the kernel picks and publishes it here: a
        # port chosen now and bound seconds later could be taken meanwhile by another pool.
        port = self._ctx.Value("i", 0, lock=False)
        self._beats = self._ctx.Array("d", world, lock=False)
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(world)]
        self._procs = [self._ctx.Process(target=rank_main, daemon=True, name=f"neopp-rank{r}",
                                         args=(r, self.spec, port, self._tasks[r], self._results, os.getpid(),
                                               self._beats))
                       for r in range(world)]
        start_processes(self._procs)
        self._await_ready(world)

    def _await_ready(self, world: int) -> None:
        ready, deadline = set(), time.monotonic() + self.spec.load_timeout_s
        while len(ready) < world:
            try:
                kind, rank, info = self._results.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in self._procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self._kill()
                    raise ConfigError(f"mode {self.mode.name}: rank workers failed to start "
                                      f"({'exit code ' + str(dead[0].exitcode) if dead else 'timeout'})") from None
                continue
            if kind == "load_error":
                self._kill()
                raise ConfigError(f"mode {self.mode.name}: rank {rank} could not load: {info}")
            ready.add(rank)

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        self._procs = []

    def _fail_and_rebuild(self, message: str) -> WorkerFailure:
        self._kill()
        self._rebuild = threading.Thread(target=self._start, name="neopp-rebuild", daemon=True)
        self._rebuild.start()
        return WorkerFailure(f"{message}; the rank workers are being restarted, retry the request")

    def _death_notice(self, wait_s: float = 1.0) -> str | None:
        """A rank's death shows first as a peer's collective error; name the dead rank instead."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]
            if dead:
                return f"rank {dead[0][0]} died (exit code {dead[0][1]}) during the request"
            if time.monotonic() > deadline:
                return None
            time.sleep(POLL_S)

    def _ensure_healthy(self) -> None:
        if self._rebuild is not None:
            self._rebuild.join()
            self._rebuild = None
        if not self._procs or any(not p.is_alive() for p in self._procs):
            self._kill()
            self._start()

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def close(self) -> None:
        with self._lock:
            self._closing = True
            for q in self._tasks:
                q.put(None)
        self._rank0_closed.wait(CLOSE_WAIT_S)
        self._pump_thread.join(CLOSE_WAIT_S)
        if self._rebuild is not None:
            self._rebuild.join()
        deadline = time.monotonic() + 5
        for p in self._procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        self._kill()
        self._release_queues()
        self._fail_all(GenerationCancelled("the engine closed before the request finished"))

    def _release_queues(self) -> None:
        """Let the queues' named semaphores be unlinked now: a stub leaves without running the
        finalizers that would, and the resource tracker then reports them as leaked."""
        queues = [*self._tasks, *([self._results] if self._results is not None else [])]
        # A queue's feeder thread holds its semaphore until it has flushed (the last item is the
        # small stop sentinel); wait for it, bounded, in case no rank reads any more.
        flushers = [threading.Thread(target=_close_and_flush, args=(q,), daemon=True) for q in queues]
        for t in flushers:
            t.start()
        deadline = time.monotonic() + 2.0
        for t in flushers:
            t.join(max(0.0, deadline - time.monotonic()))
        self._tasks, self._results = [], None
        del queues, flushers
        gc.collect()  # each semaphore's finalizer runs when its last reference goes

    # ---- requests -----------------------------------------------------------------------
    def validate(self, req: GenerationRequest) -> None:
        self.rules.validate(req)
        check_cache(self.mode, req.sampling_params)

    def submit(self, req: GenerationRequest, emit: EmitFn, cancelled: CancelledFn, preview_every: int = 0) -> None:
        ticket = self._ticket(req, emit, cancelled, preview_every)
        with self._lock:
            if self._closing:
                ticket.end(closed_error())
                return
            if self._refuse_if_full(ticket, len(self._tickets) - len(self._started)):
                return
            try:
                self._ensure_healthy()
            except Exception as exc:  # noqa: BLE001 - ranks that cannot start fail this request, not the caller
                ticket.end(WorkerFailure(f"the rank workers could not be started: {exc}"))
                return
            self._tickets[ticket.job] = ticket
            self._dispatch(ticket)

    def _dispatch(self, ticket: Ticket) -> None:
        """Hand the request to every rank (under the lock), each with the KV of its branches."""
        entry = ticket.entry
        for rank, q in enumerate(self._tasks):
            q.put(("req", ticket.job, rank_request(self.mode, entry.req, rank), entry.preview_every, entry.submitted))

    # ---- the pump ----------------------------------------------------------------------------
    def _fail_all(self, exc: Exception, replay: bool = False) -> None:
        """End every live request with ``exc``. With ``replay`` (the ranks failed and are being
        restarted) a request no step of which has run yet is kept, once, and sent again to the new
        ranks: a rank that died just before it arrived fails it at its first collective."""
        with self._lock:
            tickets, self._tickets = list(self._tickets.values()), {}
            started, self._started = self._started, set()
            again = [t for t in tickets if replay and t.job not in started and not t.entry.replayed]
            for ticket in again:
                ticket.entry.replayed = True
                self._tickets[ticket.job] = ticket
            self._replay.extend(again)
        for ticket in tickets:
            if ticket not in again:
                ticket.end(exc)

    def _send_replays(self) -> None:
        with self._lock:
            replay, self._replay = self._replay, []
            healthy = bool(self._procs) and all(p.is_alive() for p in self._procs)
            for ticket in replay if healthy else []:
                self._dispatch(ticket)
        if not healthy:
            self._fail_all(WorkerFailure("the rank workers could not be restarted"))

    def _poll_cancels(self) -> None:
        with self._lock:
            tickets = [t for t in self._tickets.values() if t.job not in self._told]
        for ticket in tickets:
            if is_cancelled(ticket):
                self._tell_cancel(ticket.job)

    def _tell_cancel(self, job: int, remember: bool = True) -> None:
        with self._lock:
            if remember:
                self._told.add(job)
            if self._tasks:
                self._tasks[0].put(("cancel", job))

    @property
    def failure(self) -> str | None:
        """Why this pool can serve no more (its event thread ended while open), else None."""
        if self._closing or self._pump_thread.is_alive():
            return None
        return "the rank pool's event thread stopped; retry the request"

    def _pump(self) -> None:
        """The events of the ranks, until rank 0 closes; a failure of this thread itself ends what
        the pool holds with ``EngineDown`` (``failure`` then says so, and the model is replaced)."""
        try:
            self._pump_events()
        except Exception as exc:  # noqa: BLE001 - nothing held is left waiting
            log.error("the rank pool's event thread failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
            self._fail_all(EngineDown("the rank pool's event thread stopped; retry the request"))

    def _pump_events(self) -> None:
        next_check = time.monotonic() + SILENCE_CHECK_S
        while not self._rank0_closed.is_set():
            self._poll_cancels()
            if self._starting.is_set() or (self._rebuild is not None and self._rebuild.is_alive()):
                time.sleep(POLL_S)  # the new ranks' start reads their queue; the old one is gone
                continue
            if self._replay:
                self._send_replays()
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
                    self._fail_all(self._fail_and_rebuild(notice), replay=True)
                continue
            self._handle(kind, job, info)

    def _handle(self, kind: str, job: int, info: Any) -> None:
        if kind == "event":
            self._event(job, info)
        elif kind == "metrics":
            waits, size, seconds, comm = info
            self.comm_seconds += comm
            for wait in waits:
                self.hooks.call("queue_wait", wait)
            self.hooks.call("batch_size", size)
            self.hooks.call("step_seconds", seconds)
        elif kind == "closed":
            self._rank0_closed.set()
        elif kind == "error" and not self._closing:
            self._fail_all(self._fail_and_rebuild(self._death_notice() or f"generation failed in {info}"),
                           replay=True)

    def _event(self, job: int, info: Any) -> None:
        step, total, preview, final, err_kind, message, seconds = info
        error = None if err_kind is None else ERRORS.get(err_kind, WorkerFailure)(message)
        ticket = self._tickets.get(job)
        if ticket is None:
            return
        self._started.add(job)
        event = StepEvent(step, total, preview=preview, final=final, error=error, seconds=seconds)
        ok = send(ticket, event)
        if not ok or event.last:
            with self._lock:
                self._tickets.pop(job, None)
                self._started.discard(job)
                self._told.discard(job)
            if not ok:  # the caller is gone: stop computing for it
                self._tell_cancel(job, remember=False)
