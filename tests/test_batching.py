"""Step batching (one process) against solo generation, request by request.

Each request's final pixels from a shared batched step must be the same bytes as its solo
`NeoPPPipeline.generate` pixels. Batching changes only how many rows the layers' float32 GEMMs
carry, and on the CPU those run in fixed row tiles (`NEOPP_ROW_TILE`, `neopp.model.kernel_choices`), so a row's sums
do not depend on its neighbours. A request that saw another one's tokens, a wrong t, grid or
prefix differs by tens of levels almost everywhere (the negative control below).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neopp.engines.batch_engine import BatchingEngine
from neopp.engines.engine import EngineHooks
from neopp.errors import GenerationCancelled, InputError, NonFiniteState, QueueFull
from neopp.modes import ModeSpec
from neopp.sampling.batching import StepBatcher, start
from neopp.sampling.pipeline import NeoPPPipeline
from testing.stream_requests import Collector, assert_pixels_match, assert_pixels_near, make, mixed, tiny_setup
from testing.tiny_checkpoint import write_tiny_checkpoint
from tests.reference import neopp_reference as ref

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ckpt, pipe, kvs = tiny_setup(tmp_path_factory.mktemp("batching"))
    return pipe, kvs, ckpt


def test_requests_joining_midway_equal_solo(setup):
    pipe, kvs, ckpt = setup
    reqs = mixed(kvs)
    solo = [pipe.generate(r) for r in reqs]
    batcher = StepBatcher(pipe)
    joins = {0: [0], 1: [1], 2: [2]}  # boundary -> requests joining there
    active, finals, boundary = [], {}, 0
    while active or boundary in joins:
        active += [start(pipe, i, reqs[i]) for i in joins.get(boundary, [])]
        events = batcher.step(active)
        for a, ev in zip(active, events):
            assert ev.error is None
            if ev.final is not None:
                finals[a.job] = ev.final
        active = [a for a, ev in zip(active, events) if not ev.last]
        boundary += 1
    for i, pixels in enumerate(solo):
        assert_pixels_match(finals[i], pixels, f"request {i}")


def test_batched_velocity_is_not_the_neighbours(setup):
    """Negative control: two different requests in one batch get different states."""
    pipe, kvs, ckpt = setup
    reqs = [make(kvs, 0, 64, 64, 2, 5), make(kvs, 1, 64, 64, 2, 5)]
    batcher = StepBatcher(pipe)
    active = [start(pipe, i, r) for i, r in enumerate(reqs)]
    batcher.step(active)
    assert (active[0].z - active[1].z).abs().max().item() > 1e-2


def run_engine(pipe, reqs, collectors, preview_every=0, **kwargs):
    waits, sizes, steps = [], [], []
    hooks = EngineHooks(queue_wait=waits.append, batch_size=sizes.append, step_seconds=steps.append)
    engine = BatchingEngine(pipe, hooks=hooks, **kwargs)
    try:
        for r, c in zip(reqs, collectors):
            engine.submit(r, c.emit, lambda c=c: c.cancel, preview_every)
        for c in collectors:
            assert c.done.wait(TIMEOUT_S)
    finally:
        engine.close()
    return waits, sizes, steps


def test_engine_cancels_one_of_three_and_the_others_stay_exact(setup):
    pipe, kvs, ckpt = setup
    reqs = mixed(kvs)
    solo = [pipe.generate(r) for r in reqs]
    collectors = [Collector(), Collector(), Collector(cancel_after=1)]
    waits, sizes, steps = run_engine(pipe, reqs, collectors)
    for i in (0, 1):
        evs = collectors[i].events
        assert [e.step for e in evs] == list(range(1, reqs[i].sampling_params.infer_steps + 1))
        assert_pixels_match(evs[-1].final, solo[i])
    last = collectors[2].events[-1]
    assert isinstance(last.error, GenerationCancelled) and last.step < reqs[2].sampling_params.infer_steps
    assert len(waits) == 3 and max(sizes) >= 2 and len(steps) == len(sizes)


def test_budget_runs_an_oversized_request_alone(setup):
    pipe, kvs, ckpt = setup
    reqs = mixed(kvs)
    collectors = [Collector(), Collector(), Collector()]
    collectors[2].cancel = True  # cancelled while queued behind the others
    _, sizes, _ = run_engine(pipe, reqs, collectors, token_budget=1)
    assert set(sizes) == {1}
    assert_pixels_match(collectors[1].events[-1].final, pipe.generate(reqs[1]))
    assert [(e.step, type(e.error)) for e in collectors[2].events] == [(0, GenerationCancelled)]


def reference_previews(ckpt, req) -> list[np.ndarray]:
    """Preview pixels after each step from the independent float64 reference."""
    s, out = req.sampling_params, []
    ref.reference_generate(ckpt, req.cond_kv, req.uncond_kv, req.index_offset_cond, req.index_offset_uncond,
                           req.height, req.width, req.noise, s.infer_steps, s.timestep_shift, s.cfg_scale,
                           s.cfg_interval, s.cfg_norm, s.enable_cfg, previews=out)
    return [ref.reference_pixels(x) for x in out]


def test_previews_equal_the_reference_prediction(setup):
    """A preview is the clean image behind the step's guided velocity (float32 vs float64: a
    value on a rounding boundary may flip, as in test_reference_equivalence)."""
    pipe, kvs, ckpt = setup
    reqs = [make(kvs, 0, 64, 96, 4, 7), make(kvs, 2, 64, 64, 4, 8, enable_cfg=False)]
    collectors = [Collector(), Collector()]
    run_engine(pipe, reqs, collectors, preview_every=2)
    for req, c in zip(reqs, collectors):
        expected = reference_previews(ckpt, req)
        previews = {e.step: e.preview for e in c.events if e.preview is not None}
        assert sorted(previews) == [2]  # step 4 is the last: it carries the final image instead
        assert_pixels_near(previews[2], expected[1], "preview after step 2")
        assert np.abs(previews[2].astype(int) - expected[2].astype(int)).max() > 1  # a step later differs


def test_non_finite_request_fails_alone(setup):
    pipe, kvs, ckpt = setup
    reqs = mixed(kvs)[:2]
    bad = make(kvs, 0, 64, 64, 2, 9)
    big = float(torch.finfo(torch.bfloat16).max)  # finite, but the state overflows to inf
    bad.cond_kv, bad.uncond_kv = torch.full_like(bad.cond_kv, big), torch.full_like(bad.uncond_kv, big)
    collectors = [Collector(), Collector(), Collector()]
    run_engine(pipe, [reqs[0], bad, reqs[1]], collectors)
    assert isinstance(collectors[1].events[-1].error, NonFiniteState)
    for i, c in zip((0, 1), (collectors[0], collectors[2])):
        assert_pixels_match(c.events[-1].final, pipe.generate(reqs[i]))


def test_a_request_that_cannot_start_fails_alone(setup):
    pipe, kvs, ckpt = setup
    good, bad = make(kvs, 0, 64, 64, 2, 3), make(kvs, 1, 64, 64, 2, 4)
    bad.noise = None
    collectors = [Collector(), Collector()]
    run_engine(pipe, [bad, good], collectors, preview_every=0)
    assert [(e.step, type(e.error)) for e in collectors[0].events] == [(0, InputError)]
    assert "noise" in str(collectors[0].events[0].error)
    assert_pixels_match(collectors[1].events[-1].final, pipe.generate(good))


def test_the_token_budget_bounds_each_step(setup):
    """Tokens x branches: 12 (guided 64x96), 6 (unguided 96x64), 4 or 8 (64x64, partly guided)."""
    pipe, kvs, ckpt = setup
    reqs = mixed(kvs)
    collectors = [Collector() for _ in reqs]
    _, sizes, _ = run_engine(pipe, reqs, collectors, token_budget=18)
    assert max(sizes) <= 2 and sum(sizes) >= 3  # never all three at once; every request ran
    for req, c in zip(reqs, collectors):
        assert_pixels_match(c.events[-1].final, pipe.generate(req))


def test_a_rows_product_does_not_depend_on_the_rows_beside_it():
    """The CPU tiles behind the byte-equality above, at widths where whole products do vary."""
    from neopp.model.layers import linear_rows

    gen = torch.Generator().manual_seed(4)
    w, b = torch.randn(2816, 1024, generator=gen), torch.randn(2816, generator=gen)
    x = torch.randn(300, 1024, generator=gen)
    full = linear_rows(x, w, b)
    for first, rows in [(0, 1), (5, 40), (130, 128), (250, 50)]:
        assert torch.equal(linear_rows(x[first:first + rows], w, b), full[first:first + rows]), (first, rows)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_a_small_request_passes_a_large_one_that_does_not_fit(setup):
    """Budget 16: a guided 64x96 request (12) runs; a second one waits for room; an unguided 64x64
    request (4) arriving behind it joins at once. With no patience (strict arrival order) it waits."""
    pipe, kvs, ckpt = setup
    big_a, big_b = make(kvs, 0, 64, 96, 3, 1), make(kvs, 1, 64, 96, 3, 2)
    small = make(kvs, 2, 64, 64, 2, 3, enable_cfg=False)
    for patience, small_first in ((16, True), (0, False)):
        collectors = [Collector(), Collector(), Collector()]
        run_engine(pipe, [big_a, big_b, small], collectors, token_budget=16, patience=patience)
        assert all(c.events[-1].final is not None for c in collectors)
        firsts = [c.first_at for c in collectors]
        assert (firsts[2] < firsts[1]) is small_first, (patience, firsts)
        assert_pixels_match(collectors[2].events[-1].final, pipe.generate(small), "small")


def test_a_full_queue_refuses_at_once_and_the_others_go_on(setup):
    pipe, kvs, ckpt = setup
    running, waiting, refused = Collector(), Collector(), Collector()
    engine = BatchingEngine(pipe, token_budget=12, max_queued=1)
    try:
        engine.submit(make(kvs, 0, 64, 96, 200, 1), running.emit, lambda: running.cancel)
        assert running.first.wait(TIMEOUT_S)  # it runs: the budget is full
        engine.submit(make(kvs, 1, 64, 96, 2, 2), waiting.emit, lambda: False)  # waits for room
        engine.submit(make(kvs, 2, 64, 96, 2, 3), refused.emit, lambda: False)
        assert refused.done.is_set() and len(refused.events) == 1
        assert isinstance(refused.events[0].error, QueueFull)
        assert str(refused.events[0].error).startswith("Exceeds maximum queue size")
        running.cancel = True
        assert waiting.done.wait(TIMEOUT_S) and waiting.events[-1].final is not None
        assert isinstance(running.events[-1].error, GenerationCancelled)
    finally:
        engine.close()


def test_moe_requests_batched_equal_solo(setup, tmp_path):
    """The routed experts see every batched request's tokens at once; each request's rows still
    come out as alone (fixed row tiles per expert product)."""
    _, kvs, _ = setup
    moe = NeoPPPipeline.from_pretrained(write_tiny_checkpoint(tmp_path / "moe", "moe", seed=4),
                                        ModeSpec(name="moe", version="moe"), "cpu", torch.float32)
    reqs = mixed(kvs)
    collectors = [Collector() for _ in reqs]
    _, sizes, _ = run_engine(moe, reqs, collectors)
    assert max(sizes) >= 2
    for req, c in zip(reqs, collectors):
        assert_pixels_match(c.events[-1].final, moe.generate(req), "moe")
