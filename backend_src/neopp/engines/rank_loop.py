"""What every rank process of a multi-rank mode runs: load, then the batched loop until told to stop.

Every request goes to every rank (each gets only the KV its branches need). At each step
boundary rank 0 asks the one scheduler which requests join, which leave (cancelled) and whether
to stop, and broadcasts that decision as int64 tensors on the world group, so every rank steps
the same batch (``StepLoop``, as the in-process engine's thread does). How a step is split
across the ranks is ``neopp.parallel.rank_step``'s. Rank 0 sends the events; the parent calls
``emit``.
"""

from __future__ import annotations

import os
import queue
from typing import Any

import torch
import torch.distributed as dist

from ..errors import GenerationCancelled, InputError, NeoPPError, NonFiniteState
from ..parallel.rank_step import ParallelStepBatcher
from ..sampling.sampler import StepEvent
from .lifeline import die_with_parent, start_heartbeat
from .scheduler import Decision, Scheduler
from .spec import EngineSpec
from .step_loop import Entry, StepLoop

# "internal": not an error of this package (an adapter torch cannot apply): the request's 500
ERRORS = {"cancelled": GenerationCancelled, "nonfinite": NonFiniteState, "input": InputError, "internal": RuntimeError}


def error_kind(exc: Exception) -> str:
    """How an event's error crosses to the parent (by name, rebuilt there with its message)."""
    for kind, cls in ERRORS.items():
        if type(exc) is cls:
            return kind
    if isinstance(exc, InputError):
        return "input"
    return "failure" if isinstance(exc, NeoPPError) else "internal"


def error_text(exc: Exception) -> str:
    """The message the parent rebuilds the error with (an internal one keeps its type's name)."""
    return str(exc) if isinstance(exc, NeoPPError) or type(exc) is RuntimeError else f"{type(exc).__name__}: {exc}"


def load_rank(rank: int, spec: EngineSpec, port: Any, results: Any, parent: int, beats: Any) -> Any:
    """A rank's start: tie it to the instance, join the mesh, load the weights, say ready.

    Returns the rank's `ParallelPipeline`, or None after reporting a load error."""
    die_with_parent(parent)
    start_heartbeat(beats, rank)
    from ..parallel.mesh import init_mesh, rendezvous
    from ..parallel.parallel_pipeline import ParallelPipeline

    try:
        if spec.threads:
            torch.set_num_threads(spec.threads)
        device = torch.device(spec.devices[rank])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = rendezvous(rank, spec.mode.world_size, port, spec.collective_timeout_s)
        mesh = init_mesh(spec.mode, rank, spec.mode.world_size, None, device, spec.collective_timeout_s,
                         store=store)
        pipe = ParallelPipeline.from_pretrained(spec.checkpoint, spec.mode, mesh, str(device), spec.dtype,
                                                spec.limits, speed=spec.speed)
        pipe.use_adapter_dir(spec.lora_dir, spec.lora_max_bytes)  # every rank loads a request's adapter by name
    except Exception as exc:  # noqa: BLE001 - reported to the instance, which refuses to load
        results.put(("load_error", rank, f"{type(exc).__name__}: {exc}"))
        return None
    results.put(("ready", rank, None))
    return pipe


class RankLoop:
    """The batched loop of one rank; rank 0 decides, the others follow its broadcasts."""

    def __init__(self, pipe: Any, tasks: Any, results: Any, parent: int, spec: EngineSpec) -> None:
        self.pipe, self.tasks, self.results, self.parent = pipe, tasks, results, parent
        self.lead = pipe.mesh.rank == 0
        self.scheduler = Scheduler(spec.token_budget, spec.patience)
        self.loop = StepLoop(pipe, ParallelStepBatcher(pipe), self._report)
        self.received: dict[int, Entry] = {}  # requests this rank holds that have not started
        self.dropped_early: set[int] = set()  # dropped by rank 0 before their message reached this rank
        self.closing = False

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
            self.scheduler.close()
        elif msg[0] == "cancel":
            self.scheduler.cancel(msg[1])
        elif msg[1] in self.dropped_early:
            self.dropped_early.discard(msg[1])
        else:
            job, req, every, submitted = msg[1:]
            self.received[job] = Entry(req, every, submitted)
            self.scheduler.enqueue(job, req.lane)
        return True

    def _gather(self) -> bool:
        """Read what is there (wait while idle); False once this rank may leave without peers."""
        while self._read(block=False):
            pass
        while not self.loop.active and not self.received:
            if self.closing:
                return False
            self._read(block=True)
        return True

    def _fetch(self, job: int) -> Entry:
        while job not in self.received:
            self._read(block=True)
        return self.received.pop(job)

    def _peek(self, job: int) -> Entry:
        while job not in self.received:
            self._read(block=True)
        return self.received[job]

    def _forget(self, job: int) -> Entry | None:
        if job in self.received:
            return self.received.pop(job)
        self.dropped_early.add(job)
        return None

    # ---- the decision, agreed by every rank -----------------------------------------------
    def _agree(self, decision: Decision | None) -> Decision:
        dev, world = self.pipe.device, self.pipe.mesh.world_group
        mine = decision or Decision()
        head = torch.tensor([int(mine.stop), len(mine.admit), len(mine.drop)], dtype=torch.int64, device=dev)
        with self.pipe.comm():
            dist.broadcast(head, src=0, group=world)
        n_admit, n_drop = int(head[1]), int(head[2])
        body = torch.tensor([*mine.admit, *mine.drop], dtype=torch.int64, device=dev) if self.lead else \
            torch.empty(n_admit + n_drop, dtype=torch.int64, device=dev)
        if n_admit + n_drop:
            with self.pipe.comm():
                dist.broadcast(body, src=0, group=world)
        ids = tuple(int(v) for v in body.tolist())
        return Decision(bool(head[0]), ids[:n_admit], ids[n_admit:])

    def _with_adapters(self, decision: Decision) -> Decision:
        """Every rank reads the adapters of the requests joining now, and the ranks agree: a request
        whose adapter failed on any rank, or was read in two versions of its file, is refused on
        all of them, so they still step one batch. The rest join holding the adapter read here."""
        joining = [(job, self._peek(job).req) for job in decision.admit]
        joining = [(job, req) for job, req in joining if req.lora is not None and req.adapter is None]
        if not joining:
            return decision
        facts = torch.zeros(len(joining), 5, dtype=torch.int64)  # [failed, the file's stamp]
        errors: dict[int, Exception] = {}
        for n, (job, req) in enumerate(joining):
            try:
                req.adapter = self.pipe.adapters.get(req.lora)
                facts[n, 1:] = torch.tensor(req.adapter.stamp or (0, 0, 0, 0))
            except Exception as exc:  # noqa: BLE001 - ours or not, it ends this request alone on every rank
                errors[job], facts[n, 0] = exc, 1
        low, high = facts.clone().to(self.pipe.device), facts.clone().to(self.pipe.device)
        with self.pipe.comm():
            dist.all_reduce(low, dist.ReduceOp.MIN, group=self.pipe.mesh.world_group)
            dist.all_reduce(high, dist.ReduceOp.MAX, group=self.pipe.mesh.world_group)
        refused = {job: errors.get(job) or InputError(
            f"LORA: adapter {req.lora!r} refused: another rank could not read it, or read another version of "
            "its file (it changed while the ranks read it)")
            for n, (job, req) in enumerate(joining) if bool(high[n, 0]) or not torch.equal(low[n, 1:], high[n, 1:])}
        for job, exc in refused.items():
            entry = self.received.pop(job)
            self._report(job, StepEvent(0, entry.req.sampling_params.infer_steps, error=exc))
        return Decision(decision.stop, tuple(j for j in decision.admit if j not in refused), decision.drop)

    def _report(self, job: int, event: StepEvent) -> bool:
        if self.lead:
            kind = None if event.error is None else error_kind(event.error)
            self.results.put(("event", job, (event.step, event.total, event.preview, event.final, kind,
                                             None if event.error is None else error_text(event.error), event.seconds)))
        return True

    def run(self) -> None:
        while self._gather():
            decision = self._agree(self.loop.decide(self.scheduler, self.received) if self.lead else None)
            if decision.stop:
                self.loop.stop(list(self.received.items()), "the engine closed")
                break
            waits = self.loop.apply(self._with_adapters(decision), self._fetch, self._forget)
            if not self.loop.active:
                continue
            comm_before = self.pipe.comm.seconds
            stats = self.loop.step()
            if self.lead:
                comm = self.pipe.comm.seconds - comm_before
                self.results.put(("metrics", 0, (waits, stats.batch, stats.seconds, comm)))
        if self.lead:
            self.results.put(("closed", 0, None))


def rank_main(rank: int, spec: EngineSpec, port: Any, tasks: Any, results: Any, parent: int, beats: Any) -> None:
    """A rank process: load, run the loop, leave the group together with its peers."""
    pipe = load_rank(rank, spec, port, results, parent, beats)
    if pipe is None:
        return
    try:
        RankLoop(pipe, tasks, results, parent, spec).run()
        pipe.close()  # the stop was broadcast: every rank leaves the group before exiting
    except Exception as exc:  # noqa: BLE001 - the group may be broken: report and leave
        results.put(("error", 0, f"rank {rank}: {type(exc).__name__}: {exc}"))
