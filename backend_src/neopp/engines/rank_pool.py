"""Rank processes inside one model instance: start, hand out requests, survive faults.

The instance (a Triton model or any caller) keeps one `WorkerPool`. Each rank is a spawned
process holding the weights and a torch.distributed group. A request goes to every rank,
with only the KV its branch needs; rank 0 answers. A dead rank or a failed collective fails
the request in flight with a clear error, and the pool is rebuilt for the next one.
"""

from __future__ import annotations

import gc
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as tmp

from ..errors import ConfigError, GenerationCancelled, InputError, WorkerFailure
from ..limits import Limits
from ..model.speed import SpeedOptions
from ..modes import ModeSpec
from ..parallel.rank_step import rank_request
from ..request import GenerationRequest
from ..sampling.pipeline import StepFn, StopFn
from ..sampling.plan import RequestRules
from .engine import CancelledFn, EmitFn, submit_in_caller
from .lifeline import die_with_parent, silent_rank, start_heartbeat, start_processes

POLL_S = 0.02
SILENCE_CHECK_S = 0.2


def _close_and_flush(q: Any) -> None:
    q.close()
    q.join_thread()


@dataclass(frozen=True)
class PoolSpec:
    ckpt_dir: str
    mode: ModeSpec
    devices: tuple[str, ...]          # one device per rank, e.g. ("cpu", "cpu") or ("cuda:0", "cuda:1")
    dtype: torch.dtype | None = None
    limits: Limits = Limits()
    threads: int | None = None
    collective_timeout_s: float = 120.0
    load_timeout_s: float = 600.0
    speed: SpeedOptions = SpeedOptions()

    @property
    def silence_s(self) -> float:
        """No heartbeat for this long fails the request: well under the collective timeout,
        yet long enough that a busy machine does not starve a healthy rank's heartbeat."""
        return min(30.0, max(2.0, self.collective_timeout_s / 4))


def load_rank(rank: int, spec: PoolSpec, port: Any, results: Any, parent: int, beats: Any) -> Any:
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
        pipe = ParallelPipeline.from_pretrained(spec.ckpt_dir, spec.mode, mesh, str(device), spec.dtype, spec.limits,
                                                speed=spec.speed)
    except Exception as exc:  # noqa: BLE001 - reported to the instance, which refuses to load
        results.put(("load_error", rank, f"{type(exc).__name__}: {exc}"))
        return None
    results.put(("ready", rank, None))
    return pipe


def _worker_main(rank: int, spec: PoolSpec, port: Any, tasks: Any, results: Any, cancel: Any, parent: int,
                 beats: Any) -> None:
    pipe = load_rank(rank, spec, port, results, parent, beats)
    if pipe is None:
        return
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            # Besides the parent-death signal (not on every platform): an orphan leaves.
            if os.getppid() != parent:
                return
            continue
        if task is None:
            pipe.close()  # every rank gets the stop sentinel: leave the group before exiting
            return
        job, req = task
        on_step = (lambda k, s, job=job: results.put(("step", job, (k, s)))) if rank == 0 else None
        try:
            comm_before = pipe.comm.seconds
            pixels = pipe.generate(req, should_stop=lambda job=job: cancel.value == job, on_step=on_step)
            if rank == 0:
                results.put(("done", job, (pixels, pipe.comm.seconds - comm_before)))
        except GenerationCancelled as exc:
            if rank == 0:
                results.put(("cancelled", job, str(exc)))
        except InputError as exc:  # e.g. a state gone non-finite: every rank holds the same state and
            if rank == 0:          # stops at the same step, so the group stays usable
                results.put(("refused", job, str(exc)))
        except Exception as exc:  # noqa: BLE001 - the group may be broken: report and leave
            results.put(("error", job, f"rank {rank}: {type(exc).__name__}: {exc}"))
            return


class WorkerPool:
    """An `Engine` whose steps run in rank processes (one per GPU on a GPU host), one request at a time."""

    # What each rank process runs; the streaming pool runs its batched loop on the same ranks.
    worker_main = staticmethod(_worker_main)

    def __init__(self, spec: PoolSpec, rules: RequestRules) -> None:
        self.spec = spec
        self.mode = spec.mode
        self.rules = rules  # the instance checks requests itself: its process holds no tower
        self.config = rules.config
        self.limits = spec.limits
        self.device = ",".join(spec.devices)
        self.dtype = spec.dtype
        self.last_comm_seconds = 0.0
        self._ctx = tmp.get_context("spawn")
        self._lock = threading.Lock()
        self._job = 0
        self._procs: list[Any] = []
        self._rebuild: threading.Thread | None = None
        self._start()

    # ---- lifecycle ----------------------------------------------------------------------
    def _start(self) -> None:
        world = self.spec.mode.world_size
        # Rank 0 binds the rendezvous store on a port the kernel picks and publishes it here: a
        # port chosen now and bound seconds later could be taken meanwhile by another pool.
        port = self._ctx.Value("i", 0, lock=False)
        self._beats = self._ctx.Array("d", world, lock=False)
        self._results = self._ctx.Queue()
        # No lock: a rank stopped while holding one would block its peers outside any collective,
        # beyond the reach of the collective timeout. One writer, aligned 64-bit reads.
        self._cancel = self._ctx.Value("q", 0, lock=False)
        self._tasks = [self._ctx.Queue() for _ in range(world)]
        self._procs = [self._ctx.Process(target=self.worker_main, daemon=True, name=f"neopp-rank{r}",
                                         args=(r, self.spec, port, self._tasks[r], self._results, self._cancel,
                                               os.getpid(), self._beats))
                       for r in range(world)]
        start_processes(self._procs)
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

    def close(self) -> None:
        if self._rebuild is not None:
            self._rebuild.join()
        for q in getattr(self, "_tasks", []):
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5
        for p in self._procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        self._kill()
        self._release_queues()

    def _release_queues(self) -> None:
        """Let the queues' named semaphores be unlinked now: a stub leaves without running the
        finalizers that would, and the resource tracker then reports them as leaked."""
        queues = [*getattr(self, "_tasks", []), *([self._results] if getattr(self, "_results", None) else [])]
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

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ---- requests -----------------------------------------------------------------------
    def validate(self, req: GenerationRequest) -> None:
        self.rules.validate(req)

    def _rank_request(self, req: GenerationRequest, rank: int) -> GenerationRequest:
        return rank_request(self.mode, req, rank)

    def submit(self, req: GenerationRequest, emit: EmitFn, cancelled: CancelledFn, preview_every: int = 0) -> None:
        """Runs in the caller's thread, reporting each step (no previews on this engine)."""
        submit_in_caller(self.generate, req, emit, cancelled)

    def generate(self, req: GenerationRequest, should_stop: StopFn | None = None,
                 on_step: StepFn | None = None, timeout_s: float | None = None) -> np.ndarray:
        with self._lock:
            steps: list[int] = []

            def counted(k: int, seconds: float) -> None:
                steps.append(k)
                if on_step is not None:
                    on_step(k, seconds)

            try:
                return self._dispatch(req, should_stop, counted, timeout_s)
            except WorkerFailure:
                # A rank that died just before the request (not yet reaped) fails it at its
                # first collective; nothing was computed, so it is safe to run it once more.
                if steps:
                    raise
            return self._dispatch(req, should_stop, counted, timeout_s)

    def _dispatch(self, req: GenerationRequest, should_stop: StopFn | None, on_step: StepFn,
                  timeout_s: float | None) -> np.ndarray:
        """Hand the request to every rank (on a healthy pool) and wait for rank 0's answer."""
        self._ensure_healthy()
        self._job += 1
        self._cancel.value = 0
        for rank, q in enumerate(self._tasks):
            q.put((self._job, self._rank_request(req, rank)))
        return self._await(self._job, should_stop, on_step, timeout_s)

    def _await(self, job: int, should_stop: StopFn | None, on_step: StepFn | None,
               timeout_s: float | None) -> np.ndarray:
        deadline = time.monotonic() + (timeout_s or 10 * self.spec.collective_timeout_s)
        next_check = time.monotonic() + SILENCE_CHECK_S
        while True:
            if should_stop is not None and self._cancel.value != job and should_stop():
                self._cancel.value = job
            try:
                kind, got_job, info = self._results.get(timeout=POLL_S)
            except queue.Empty:
                notice = self._death_notice(wait_s=0)
                if notice:
                    raise self._fail_and_rebuild(notice) from None
                if time.monotonic() > next_check:
                    next_check = time.monotonic() + SILENCE_CHECK_S
                    notice = silent_rank(self.pids(), self._beats, self.spec.silence_s)
                    if notice:
                        raise self._fail_and_rebuild(f"{notice} during the request") from None
                if time.monotonic() > deadline:
                    raise self._fail_and_rebuild("the request exceeded its time limit") from None
                continue
            if got_job != job:
                continue  # a late message of an earlier, failed request
            if kind == "step" and on_step is not None:
                on_step(*info)
            elif kind == "done":
                pixels, self.last_comm_seconds = info
                return pixels
            elif kind == "cancelled":
                raise GenerationCancelled(info)
            elif kind == "refused":
                raise InputError(info)
            elif kind == "error":
                raise self._fail_and_rebuild(self._death_notice() or f"generation failed in {info}")


def instance_devices(world_size: int, instance_index: int = 0, gpus: list[int] | None = None) -> tuple[str, ...]:
    """Devices of one instance's ranks: disjoint GPU sets per instance, else the CPU."""
    if not torch.cuda.is_available():
        return ("cpu",) * world_size
    gpus = gpus if gpus is not None else list(range(torch.cuda.device_count()))
    first = instance_index * world_size
    if first + world_size > len(gpus):
        raise ConfigError(f"instance {instance_index} needs GPUs {first}..{first + world_size - 1} "
                          f"but only {len(gpus)} are available ({gpus}); lower the instance count")
    return tuple(f"cuda:{g}" for g in gpus[first:first + world_size])
