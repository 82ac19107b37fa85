"""The one step scheduler: which requests run the next batched step.

Every step-batching engine asks it at each step boundary: the in-process engine from its loop
thread, a rank pool from rank 0 (which then broadcasts the answer, so every rank steps the
same batch). It knows requests only by job number and asks the caller what a request costs.

* **Budget.** A step carries at most ``budget`` image tokens x guidance branches. Requests join
  while the sum fits; a request bigger than the whole budget runs, but alone.
* **Turns between clients.** Each request waits in its client's lane (``neopp.contract.client_lanes``).
  Lanes take turns, starting after the lane served last, and each lane's requests keep their
  arrival order: a request of a client with nothing running is among the first considered,
  however many another client queued before it.
* **No head-of-line blocking.** A queued request that does not fit lets the ones after it,
  smaller, join past it, so a small request arriving behind large ones starts at the next step.
  Once the first request considered that does not fit has waited ``patience`` steps, nothing
  passes it any more:
  running requests leave one by one and it starts as soon as it fits, so no size starves.
* **Which running requests step** is the step loop's fair share between sizes
  (``neopp.engines.step_loop.fair_turn``); the budget counts every running request.
* **Cancellation** takes effect at the next step boundary, queued or running.
* **Close** stops everything at the next boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Steps the oldest request that does not fit may wait while smaller ones pass it, before it has the
# right of way.
DEFAULT_PATIENCE = 16
# Tokens x branches one step may carry: 8 guided 512x512 requests (1024 tokens each, 2 branches).
DEFAULT_TOKEN_BUDGET = 16384
# Requests that may wait to start; beyond it a request is refused at once ("retry later").
DEFAULT_MAX_QUEUED = 64


@dataclass(frozen=True)
class Decision:
    """What happens at one step boundary: stop everything, or drop and admit these jobs."""

    stop: bool = False
    admit: tuple[int, ...] = ()
    drop: tuple[int, ...] = ()


def fits(used: int, cost: int, budget: int, alone: bool) -> bool:
    """A request joins if the budget allows; one bigger than the budget runs, but alone."""
    return alone or used + cost <= budget


class Scheduler:
    """Admission within a per-step budget, cancellation and close (see the module's rules)."""

    def __init__(self, budget: int, patience: int = DEFAULT_PATIENCE) -> None:
        if budget < 1:
            raise ValueError(f"token_budget: must be positive, got {budget}")
        if patience < 0:
            raise ValueError(f"patience: must not be negative, got {patience}")
        self.budget, self.patience = budget, patience
        self.queue: list[int] = []  # waiting jobs, in arrival order
        self.lanes: dict[int, str] = {}  # waiting job -> its client's lane
        self._served: str | None = None  # the lane of the job admitted last
        self.cancelled: set[int] = set()
        self.closing = False
        self._blocked: tuple[int, int] | None = None  # (oldest job that did not fit, steps it has waited so)

    def enqueue(self, job: int, lane: str = "") -> None:
        self.queue.append(job)
        self.lanes[job] = lane

    def cancel(self, job: int) -> None:
        self.cancelled.add(job)

    def close(self) -> None:
        self.closing = True

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def decide(self, active: Sequence[int], cost: Callable[[int], int]) -> Decision:
        """The decision for the next step; ``active`` are the running jobs, ``cost(job)`` what a job's
        next step carries (tokens x branches)."""
        if self.closing:
            return Decision(stop=True)
        drop = tuple(job for job in (*active, *self.queue) if job in self.cancelled)
        self.cancelled.clear()  # a cancellation of a job no longer here has nothing left to stop
        gone = set(drop)
        running = [job for job in active if job not in gone]
        self._keep(lambda job: job not in gone)
        admit = self._admit(running, cost)
        return Decision(admit=admit, drop=drop)

    def _admit(self, running: list[int], cost: Callable[[int], int]) -> tuple[int, ...]:
        used = sum(cost(job) for job in running)
        admit: list[int] = []
        oldest_blocked: int | None = None
        for job in self.turns():
            c = cost(job)
            if fits(used, c, self.budget, alone=not running and not admit):
                admit.append(job)
                used += c
            elif oldest_blocked is None:
                oldest_blocked = job
                if self._right_of_way(job):
                    break
        self._note_blocked(oldest_blocked)
        chosen = set(admit)
        if admit:
            self._served = self.lanes[admit[-1]]
        self._keep(lambda job: job not in chosen)
        return tuple(admit)

    def turns(self) -> list[int]:
        """The waiting jobs in the order they are considered: lanes take turns (in the order their
        first waiting job arrived, starting after the lane served last), one job of each per round."""
        by_lane: dict[str, list[int]] = {}
        for job in self.queue:
            by_lane.setdefault(self.lanes[job], []).append(job)
        names = list(by_lane)
        if self._served in by_lane:
            after = names.index(self._served) + 1
            names = names[after:] + names[:after]
        rounds = max((len(jobs) for jobs in by_lane.values()), default=0)
        return [by_lane[name][i] for i in range(rounds) for name in names if i < len(by_lane[name])]

    def _keep(self, wanted: Callable[[int], bool]) -> None:
        """Keep the waiting jobs ``wanted`` says to keep (and forget the others' lanes)."""
        for job in self.queue:
            if not wanted(job):
                self.lanes.pop(job, None)
        self.queue = [job for job in self.queue if job in self.lanes]

    def _right_of_way(self, job: int) -> bool:
        waited = self._blocked[1] if self._blocked is not None and self._blocked[0] == job else 0
        return waited >= self.patience

    def _note_blocked(self, job: int | None) -> None:
        """Count the steps the oldest request that does not fit has waited."""
        if job is None:
            self._blocked = None
        elif self._blocked is None or self._blocked[0] != job:
            self._blocked = (job, 1)
        else:
            self._blocked = (job, self._blocked[1] + 1)
