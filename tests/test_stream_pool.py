"""The batched loop on CFG-parallel rank processes (real processes, gloo) against one process.

Ranks run the same float32 layer code on their branches (or token shards, or head shards), the
CFG sum adds exact zeros, and CPU GEMMs run in fixed row tiles (`NEOPP_ROW_TILE`, `neopp.model.kernel_choices`), so a
row's sums do not depend on which rows share its product: the pool's pixels are the same bytes
as one process's.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from neopp.engines.batch_engine import BatchingEngine
from neopp.engines.engine import EngineHooks
from neopp.engines.factory import build_engine
from neopp.engines.spec import EngineSpec
from neopp.errors import GenerationCancelled, WorkerFailure
from neopp.modes import load_mode
from testing.stream_requests import Collector, assert_pixels_match, make, mixed, tiny_setup

MODES = {"cfg": "configs/neopp/neopp_dense_parallel_cfg.json",
         "cfg_seq": "configs/neopp/neopp_dense_parallel_cfg_seq.json"}
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("stream_pool"))


def run(engine, reqs, collectors, preview_every=0) -> None:
    try:
        for r, c in zip(reqs, collectors):
            engine.submit(r, c.emit, lambda c=c: c.cancel, preview_every)
        for c in collectors:
            assert c.done.wait(TIMEOUT_S), "a request never ended"
    finally:
        engine.close()


@pytest.mark.parametrize("name", ["cfg", "cfg_seq"])
def test_pool_equals_single_process_batching(setup, name):
    ckpt, pipe, kvs = setup
    # The first request runs 80 steps, so the others join it whatever the machine's load; the last
    # is cancelled after its first step, long before its 100th.
    reqs = [make(kvs, 2, 64, 64, 80, 5)] + mixed(kvs) + [make(kvs, 1, 64, 64, 100, 11)]
    kept = len(reqs) - 1
    single = [Collector() for _ in reqs[:kept]]
    run(BatchingEngine(pipe), reqs[:kept], single, preview_every=2)
    sizes: list[int] = []
    pool = build_engine(EngineSpec.local(ckpt, load_mode(MODES[name]), dtype=torch.float32, threads=1),
                        EngineHooks(batch_size=sizes.append))
    pids = pool.pids()
    assert len(pids) == load_mode(MODES[name]).world_size
    collectors = [Collector() for _ in reqs[:kept]] + [Collector(cancel_after=1)]
    run(pool, reqs, collectors, preview_every=2)
    for i in range(kept):
        got, want = collectors[i].events, single[i].events
        steps = reqs[i].sampling_params.infer_steps
        assert [e.step for e in got] == [e.step for e in want] == list(range(1, steps + 1))
        assert_pixels_match(got[-1].final, want[-1].final, f"request {i} final")
        for g, w in zip(got, want):
            assert (g.preview is None) == (w.preview is None)
            if g.preview is not None:
                assert_pixels_match(g.preview, w.preview, f"request {i} preview at {g.step}")
    last = collectors[kept].events[-1]
    assert isinstance(last.error, GenerationCancelled) and last.step < 100
    assert max(sizes) >= 2, "the pool never batched two requests"
    assert all(not _alive(p) for p in pids)


def test_pool_close_cancels_what_is_queued(setup):
    ckpt, _, kvs = setup
    pool = build_engine(EngineSpec.local(ckpt, load_mode(MODES["cfg"]), dtype=torch.float32, threads=1))
    c = Collector()
    pool.submit(make(kvs, 0, 64, 64, 40, 5), c.emit, lambda: False)
    pool.close()
    assert c.done.wait(TIMEOUT_S)
    assert isinstance(c.events[-1].error, GenerationCancelled)
    late = Collector()
    pool.submit(make(kvs, 0, 64, 64, 2, 5), late.emit, lambda: False)
    assert isinstance(late.events[-1].error, GenerationCancelled)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_dead_rank_fails_the_live_requests_and_the_pool_recovers(setup):
    ckpt, pipe, kvs = setup
    pool = build_engine(EngineSpec.local(ckpt, load_mode(MODES["cfg"]), dtype=torch.float32, threads=1))
    try:
        victim = pool.pids()[1]
        c = Collector()

        def emit(ev):
            c.emit(ev)
            if ev.step == 1 and not ev.last:
                os.kill(victim, signal.SIGKILL)  # a rank this test's pool started

        pool.submit(make(kvs, 0, 64, 64, 30, 5), emit, lambda: False)
        assert c.done.wait(TIMEOUT_S)
        assert isinstance(c.events[-1].error, WorkerFailure), c.events[-1]
        after = Collector()
        req = make(kvs, 1, 64, 64, 2, 6)
        pool.submit(req, after.emit, lambda: False)
        assert after.done.wait(TIMEOUT_S)
        assert victim not in pool.pids()
        assert_pixels_match(after.events[-1].final, pipe.generate(req), "after the rebuild")
    finally:
        pool.close()
