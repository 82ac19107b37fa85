"""Step batching on a pool of CFG-parallel (optionally Ulysses) rank processes.

The ranks are `WorkerPool`'s (same start, health checks, rebuild, close); they run the batched
loop instead of one request at a time. Every request goes to every rank (each gets only the
KV its branch needs). At each step boundary rank 0 decides which requests join, which leave
(cancelled) and whether to stop, and broadcasts that decision as an int64 tensor on the world
group, so every rank steps the same batch. In a step, each CFG rank computes the branches
``ParallelPipeline.prepare`` gave it (cond on rank 0, the others on rank 1), all in one pass
of the layers; a sum over the CFG group of zero-filled buffers gives every rank every velocity
(adding exact zeros changes no bit). Rank 0 sends the events; the parent calls ``emit``.
"""

from __future__ import annotations

import os
import queue
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import GenerationCancelled, InputError, NeoPPError, NonFiniteState
from ..parallel.rank_step import ParallelStepBatcher
from ..request import GenerationRequest
from ..sampling.batching import Active, fits, start, step_cost
from ..sampling.sampler import StepEvent
from .engine import DEFAULT_TOKEN_BUDGET
from .rank_pool import PoolSpec, load_rank

ERRORS = {"cancelled": GenerationCancelled, "nonfinite": NonFiniteState, "input": InputError}


def error_kind(exc: Exception) -> str:
    """How an event's error crosses to the parent (by name, rebuilt there with its message)."""
    for kind, cls in ERRORS.items():
        if type(exc) is cls:
            return kind
    return "input" if isinstance(exc, InputError) else "failure"


@dataclass(frozen=True)
class StreamPoolSpec(PoolSpec):
    token_budget: int = DEFAULT_TOKEN_BUDGET


class RankLoop:
    """The batched loop every rank runs; rank 0 decides, the others follow its broadcasts."""

    def __init__(self, pipe: Any, tasks: Any, results: Any, parent: int, budget: int) -> None:
        self.pipe, self.tasks, self.results, self.parent, self.budget = pipe, tasks, results, parent, budget
        self.batcher = ParallelStepBatcher(pipe)
        self.lead = pipe.mesh.rank == 0
        self.received: dict[int, tuple[GenerationRequest, int, float]] = {}
        self.undecided: deque[int] = deque()
        self.dropped_early: set[int] = set()
        self.cancels: set[int] = set()
        self.active: list[Active] = []
        self.prepared: dict[int, Active] = {}  # rank 0: requests sized for admission, not yet admitted
        self.closing = False
        self.waits: list[float] = []

    # ---- messages from the parent --------------------------------------------------------
    def _read(self, block: bool) -> bool:
        """Take one message; False when none came (an orphaned rank leaves here)."""
        try:
            msg = self.tasks.get(timeout=1.0) if block else self.tasks.get_nowait()
        except queue.Empty:
            if os.getppid() != self.parent:
                raise SystemExit(0) from None
            return False
        if msg is None:
            self.closing = True
        elif msg[0] == "cancel":
            self.cancels.add(msg[1])
        elif msg[1] in self.dropped_early:
            self.dropped_early.discard(msg[1])
        else:
            self.received[msg[1]] = msg[2:]
            self.undecided.append(msg[1])
        return True

    def _idle(self) -> bool:
        return not self.active and not self.undecided

    def _gather_messages(self) -> bool:
        """Read what is there (wait while idle); False once this rank may leave without peers."""
        while self._read(block=False):
            pass
        while self._idle():
            if self.closing:
                return False
            self._read(block=True)
        return True

    def _fetch(self, job: int) -> tuple[GenerationRequest, int, float]:
        while job not in self.received:
            self._read(block=True)
        self.undecided.remove(job)
        return self.received.pop(job)

    # ---- the decision ---------------------------------------------------------------------
    def _decide(self) -> tuple[bool, list[int], list[int]]:
        live = [a.job for a in self.active] + list(self.undecided)
        drop = [job for job in live if job in self.cancels]
        for job in drop:
            self.prepared.pop(job, None)
        used = sum(step_cost(self.pipe, a) for a in self.active if a.job not in drop)
        alone = all(a.job in drop for a in self.active)
        admit: list[int] = []
        for job in [j for j in self.undecided if j not in drop]:
            if job not in self.prepared:
                req, every, submitted = self.received[job]
                try:
                    self.prepared[job] = start(self.pipe, job, req, every, submitted)
                except NeoPPError:  # every rank meets the same error at admission and reports it
                    admit.append(job)
                    continue
            cost = step_cost(self.pipe, self.prepared[job])
            if not fits(used, cost, self.budget, alone and not admit):
                break
            admit.append(job)
            used += cost
        return self.closing, admit, drop

    def _broadcast(self, stop: bool, admit: list[int], drop: list[int]) -> tuple[bool, list[int], list[int]]:
        dev, world = self.pipe.device, self.pipe.mesh.world_group
        head = torch.tensor([int(stop), len(admit), len(drop)], dtype=torch.int64, device=dev)
        with self.pipe.comm():
            dist.broadcast(head, src=0, group=world)
        n_admit, n_drop = int(head[1]), int(head[2])
        body = torch.tensor(admit + drop, dtype=torch.int64, device=dev) if self.lead else \
            torch.empty(n_admit + n_drop, dtype=torch.int64, device=dev)
        if n_admit + n_drop:
            with self.pipe.comm():
                dist.broadcast(body, src=0, group=world)
        ids = [int(v) for v in body.tolist()]
        return bool(head[0]), ids[:n_admit], ids[n_admit:]

    # ---- applying it ------------------------------------------------------------------------
    def _event(self, job: int, ev: StepEvent) -> None:
        if not self.lead:
            return
        kind = None if ev.error is None else error_kind(ev.error)
        self.results.put(("event", job, (ev.step, ev.total, ev.preview, ev.final, kind,
                                         None if ev.error is None else str(ev.error))))

    def _apply(self, admit: list[int], drop: list[int]) -> None:
        for job in drop:
            a = next((a for a in self.active if a.job == job), None)
            if a is not None:
                self.active.remove(a)
                self._event(job, StepEvent(a.k, a.total, error=GenerationCancelled(
                    f"cancelled before step {a.k + 1} of {a.total}")))
            elif job in self.received:
                req = self.received.pop(job)[0]
                self.undecided.remove(job)
                self._event(job, StepEvent(0, req.sampling.infer_steps, error=GenerationCancelled(
                    "cancelled before it started")))
            else:
                self.dropped_early.add(job)
        waits = []
        for job in admit:
            req, every, submitted = self._fetch(job)
            try:
                a = self.prepared.pop(job, None) or start(self.pipe, job, req, every, submitted)
            except NeoPPError as exc:
                self._event(job, StepEvent(0, req.sampling.infer_steps, error=exc))
                continue
            self.active.append(a)
            waits.append(time.monotonic() - submitted)
        self.waits = waits

    def _stop(self) -> None:
        for a in self.active:
            self._event(a.job, StepEvent(a.k, a.total, error=GenerationCancelled("the engine closed")))
        for job in list(self.undecided):
            req = self.received[job][0]
            self._event(job, StepEvent(0, req.sampling.infer_steps, error=GenerationCancelled("the engine closed")))

    def run(self) -> None:
        self._loop()
        if self.lead:
            self.results.put(("closed", 0, None))

    def _loop(self) -> None:
        while self._gather_messages():
            decision = self._decide() if self.lead else (False, [], [])
            stop, admit, drop = self._broadcast(*decision)
            if stop:
                self._stop()
                return
            self._apply(admit, drop)
            if not self.active:
                continue
            began = time.perf_counter()
            events = self.batcher.step(self.active)
            for a, ev in zip(self.active, events):
                self._event(a.job, ev)
            if self.lead:
                self.results.put(("metrics", 0, (self.waits, len(self.active), time.perf_counter() - began)))
            self.active = [a for a, ev in zip(self.active, events) if not ev.last]


def _stream_rank_main(rank: int, spec: StreamPoolSpec, port: Any, tasks: Any, results: Any, cancel: Any,
                      parent: int, beats: Any) -> None:
    pipe = load_rank(rank, spec, port, results, parent, beats)
    if pipe is None:
        return
    try:
        RankLoop(pipe, tasks, results, parent, spec.token_budget).run()
        pipe.close()  # the stop was broadcast: every rank leaves the group before exiting
    except Exception as exc:  # noqa: BLE001 - the group may be broken: report and leave
        results.put(("error", 0, f"rank {rank}: {type(exc).__name__}: {exc}"))
