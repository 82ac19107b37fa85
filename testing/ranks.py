"""Run a test's rank function in real processes (spawn) and collect what each rank sends back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from neopp.ports import free_ports


def _rank_entry(target: Callable[..., None], *args: Any) -> None:
    """The test's rank function, then the group left: a process exiting with a live gloo group
    can abort in teardown."""
    from neopp.parallel.mesh import leave_mesh

    try:
        target(*args)
    finally:
        leave_mesh()


def run_ranks(target: Callable[..., None], world: int, args: tuple, timeout_s: float = 300.0) -> dict[int, tuple]:
    """``target(rank, world, port, *args, out)`` in ``world`` processes on one rendezvous port; each
    puts ``(rank, *payload)`` on ``out``. Returns rank -> payload; every process is joined or killed."""
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    port = free_ports(1)[0]
    procs = [ctx.Process(target=_rank_entry, args=(target, r, world, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    try:
        for _ in range(world):
            rank, *payload = out.get(timeout=timeout_s)
            results[rank] = tuple(payload)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results
