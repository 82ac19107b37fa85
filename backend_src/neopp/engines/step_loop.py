"""The batched denoising loop, written once: the in-process engine's thread and every rank run it.

Around each step the :class:`~neopp.engines.scheduler.Scheduler`'s decision is applied (a
cancelled request leaves with its cancellation, an admitted one is prepared and joins), the
batch advances one step (``StepBatcher.step``: every request on its own grid, time and
guidance, the layers run once for all) and finished or failed requests leave. What differs
between a thread and a rank group is passed in: where a request's data comes from (``fetch``),
how a dropped request that never started is forgotten (``forget``) and where events go
(``report``; a rank other than 0 reports nothing).

**Fair share between sizes.** A step costs every request in it the whole step's time, so a small
request batched with large ones would be charged for their tokens at every step. Each running
request counts what it has been stepped for (``served``: tokens x branches of its plan, as the
scheduler's budget counts them but for a step cache's skips, which could differ between ranks);
a step takes the requests within one smallest step of the least served
(``fair_turn``). Requests of one size all step every time, as before; a 256x256 request beside
512x512 ones steps about four times for each of their steps, and theirs carry on alone once it
is done. A request joins at the least served count running, so it gets no credit for the time it
waited, and the least served request always steps, so none starves. Every rank holds the same
requests in the same state, so every rank picks the same turn without a word exchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import GenerationCancelled
from ..request import GenerationRequest
from ..sampling.batching import Active, StepBatcher, planned_cost, start, step_cost
from ..sampling.pipeline import NeoPPPipeline
from ..sampling.plan import step_plan
from ..sampling.sampler import StepEvent
from .scheduler import Decision, Scheduler


@dataclass
class Entry:
    """A request the loop was handed: what it is, its previews, when it arrived."""

    req: GenerationRequest
    preview_every: int = 0
    submitted: float = 0.0
    replayed: bool = False  # sent again once already, after its ranks failed before its first step


ReportFn = Callable[[int, StepEvent], bool]  # False: the caller is gone, stop computing for it


def fair_turn(active: list[Active], cost: Callable[[Active], int]) -> list[Active]:
    """The running requests that take the next step: those served less than the least served one
    plus the smallest step."""
    if not active:
        return []
    least = min(a.served for a in active)
    smallest = min(cost(a) for a in active)
    return [a for a in active if a.served < least + smallest]


def queued_cost(pipe: NeoPPPipeline, req: GenerationRequest) -> int:
    """Tokens x branches of a request's first step, known before it is prepared."""
    t = pipe.config.token_size
    return (req.height // t) * (req.width // t) * len(step_plan(req).branch_names(0))


@dataclass
class StepStats:
    """What one pass of the loop did, for the metrics hooks."""

    waits: list[float]      # seconds each admitted request waited
    batch: int = 0          # requests in the step
    seconds: float = 0.0    # wall time of the step


class StepLoop:
    """The active requests of one process and how they move: admit, drop, step, leave."""

    def __init__(self, pipe: NeoPPPipeline, batcher: StepBatcher, report: ReportFn) -> None:
        self.pipe, self.batcher, self.report = pipe, batcher, report
        self.active: list[Active] = []

    @property
    def jobs(self) -> list[int]:
        return [a.job for a in self.active]

    def cost(self, job: int, entries: dict[int, Entry]) -> int:
        """What ``job``'s next step carries, running or queued (the scheduler's cost)."""
        for a in self.active:
            if a.job == job:
                return step_cost(self.pipe, a)
        return queued_cost(self.pipe, entries[job].req)

    def decide(self, scheduler: Scheduler, entries: dict[int, Entry]) -> Decision:
        return scheduler.decide(self.jobs, lambda job: self.cost(job, entries))

    def apply(self, decision: Decision, fetch: Callable[[int], Entry],
              forget: Callable[[int], Entry | None]) -> list[float]:
        """Drop, then admit; the seconds each admitted request waited."""
        for job in decision.drop:
            self._drop(job, forget)
        waits = []
        joined_at = min((a.served for a in self.active), default=0)
        for job in decision.admit:
            entry = fetch(job)
            try:
                a = start(self.pipe, job, entry.req, entry.preview_every, entry.submitted)
            except Exception as exc:  # noqa: BLE001 - ours or not (an adapter torch cannot apply): every rank
                # meets the same error here, the request fails alone and its host logs an unexpected one once
                self.report(job, StepEvent(0, entry.req.sampling_params.infer_steps, error=exc))
                continue
            a.served = joined_at
            self.active.append(a)
            waits.append(time.monotonic() - entry.submitted)
        return waits

    def _drop(self, job: int, forget: Callable[[int], Entry | None]) -> None:
        a = next((a for a in self.active if a.job == job), None)
        if a is not None:
            self.active.remove(a)
            self.pipe.release(a.prep)
            self.report(job, StepEvent(a.k, a.total, error=GenerationCancelled(
                f"cancelled before step {a.k + 1} of {a.total}")))
            return
        entry = forget(job)
        if entry is not None:
            self.report(job, StepEvent(0, entry.req.sampling_params.infer_steps,
                                       error=GenerationCancelled("cancelled before it started")))

    def step(self) -> StepStats:
        """One batched step of the requests whose turn it is; finished, failed and abandoned
        requests leave."""
        began = time.perf_counter()
        costs = {a.job: planned_cost(self.pipe, a) for a in self.active}
        turn = fair_turn(self.active, lambda a: costs[a.job])
        for a in turn:
            a.served += costs[a.job]
        events = self.batcher.step(turn)
        seconds = time.perf_counter() - began
        leaving = set()
        for a, ev in zip(turn, events):
            ev.seconds = seconds
            if not self.report(a.job, ev) or ev.last:
                leaving.add(a.job)
                self.pipe.release(a.prep)
        self.active = [a for a in self.active if a.job not in leaving]
        return StepStats([], len(turn), seconds)

    def fail_all(self, exc: Exception) -> None:
        """A failure of the shared pass fails every running request, those that sat out this turn
        too (a failure that would recur could otherwise never end); the loop goes on."""
        for a in self.active:
            self.report(a.job, StepEvent(a.k, a.total, error=exc))
            self.pipe.release(a.prep)
        self.active = []

    def stop(self, queued: list[tuple[int, Entry]], reason: str) -> None:
        """Close: every running and queued request ends with a cancellation."""
        for a in self.active:
            self.report(a.job, StepEvent(a.k, a.total, error=GenerationCancelled(reason)))
            self.pipe.release(a.prep)
        self.active = []
        for job, entry in queued:
            self.report(job, StepEvent(0, entry.req.sampling_params.infer_steps, error=GenerationCancelled(reason)))
