"""Two plain instances for the continuous-batching benchmark: two processes, each with its own
pipeline (weights twice), sharing the device as two Triton model instances on one GPU would.

The parent sends each cell (size, N, steps) to both; each waits at a barrier, generates its
half of the N requests one after another, and reports. The cell's time is from the barrier
to the later of the two.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

import torch

from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline

# (geometry, dtype name, device, threads) -> (pipeline, raw config); must be importable by a spawned child.
Loader = Callable[[str, torch.dtype, str], tuple[NeoPPPipeline, dict]]
Requests = Callable[[dict, int, int, int], list[GenerationRequest]]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _instance(index: int, load: Loader, make: Requests, setup: tuple[str, str, str, int],
              jobs: Any, results: Any, barrier: Any) -> None:
    name, dtype, device, threads = setup
    torch.set_num_threads(threads)
    pipe, raw = load(name, getattr(torch, dtype), device)
    results.put(("ready", index, torch.cuda.memory_allocated() if device.startswith("cuda") else 0))
    while (job := jobs.get()) is not None:
        size, n, steps = job
        mine = make(raw, n, size, steps)[index::2]
        barrier.wait()
        start = time.perf_counter()
        for req in mine:
            pipe.generate(req)
        _sync(device)
        results.put(("done", index, time.perf_counter() - start))


class TwoInstances:
    """Two pipeline processes that run one benchmark cell at a time, side by side."""

    def __init__(self, load: Loader, make: Requests, name: str, dtype: str, device: str, threads: int) -> None:
        ctx = mp.get_context("spawn")
        self._jobs = [ctx.Queue(), ctx.Queue()]
        self._results = ctx.Queue()
        self._barrier = ctx.Barrier(2)
        self._procs = [ctx.Process(target=_instance, daemon=True,
                                   args=(i, load, make, (name, dtype, device, threads), self._jobs[i],
                                         self._results, self._barrier)) for i in range(2)]
        for p in self._procs:
            p.start()
        self.weight_bytes = [self._expect("ready")[1] for _ in self._procs]

    def _expect(self, kind: str) -> tuple[int, float]:
        got, index, value = self._results.get(timeout=3600)
        if got != kind:
            raise RuntimeError(f"instance {index} answered {got!r}, expected {kind!r}")
        return index, value

    def run(self, size: int, n: int, steps: int) -> float:
        """Wall seconds until both instances finished their halves of the N requests."""
        for q in self._jobs:
            q.put((size, n, steps))
        return max(self._expect("done")[1] for _ in self._procs)

    def close(self) -> None:
        for q in self._jobs:
            q.put(None)
        for p in self._procs:
            p.join(60)
            if p.is_alive():
                p.kill()
