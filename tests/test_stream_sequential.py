"""SequentialStreamEngine over the real pipeline (float32, CPU): event order, final pixels,
previews against the float64 reference, cancellation, the FIFO queue and close().

Preview tolerance: a preview is z + max(1 - t, 0.02) * v, the state plus a velocity scaled by
at most 1, so its float32 error is of the order of the whole-run error that
test_reference_equivalence bounds (X_RTOL = 2e-5 of the image's scale). Turned into uint8 pixels
that can flip a rounding at a .5 boundary and nothing more: at most 1 level, on under 1% of the
values (the same rule that test applies to the final pixels).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from neopp.errors import GenerationCancelled
from neopp.modes import ModeSpec, SamplingParams
from neopp.pipeline import GenerationRequest, NeoPPPipeline
from neopp.rng import NoiseStream
from neopp.stream_sequential import SequentialStreamEngine
from neopp.streaming import StepEvent
from testing.tiny_checkpoint import random_kv, tiny_config, write_tiny_checkpoint
from tests.reference import neopp_reference as ref

pytestmark = pytest.mark.usefixtures("one_thread")
CFG = tiny_config("dense")
H, W = 64, 96


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("stream") / "dense", "dense")


@pytest.fixture(scope="module")
def pipe(ckpt):
    return NeoPPPipeline.from_pretrained(ckpt, ModeSpec(name="test", version="dense"), device="cpu",
                                         dtype=torch.float32)


def request(steps: int = 4, seed: int = 5, **sampling) -> GenerationRequest:
    sampling = {"cfg_scale": 4.0, "cfg_norm": "global", **sampling}
    return GenerationRequest(cond_kv=random_kv(CFG, 12, seed=1, dtype=torch.float32), index_offset_cond=12,
                             height=H, width=W, noise=NoiseStream(seed).draw(H, W),
                             sampling=SamplingParams(infer_steps=steps, **sampling),
                             uncond_kv=random_kv(CFG, 3, seed=2, dtype=torch.float32), index_offset_uncond=3)


class Collector:
    """Events of one request, and an event set when its last one arrived."""

    def __init__(self, fail_on_step: bool = False, order: list | None = None, name: int = 0) -> None:
        self.events: list[StepEvent] = []
        self.done = threading.Event()
        self.fail_on_step, self.order, self.name = fail_on_step, order, name

    def __call__(self, event: StepEvent) -> None:
        self.events.append(event)
        if event.last:
            if self.order is not None:
                self.order.append(self.name)
            self.done.set()
        elif self.fail_on_step:
            raise ConnectionError("client gone")

    def wait(self) -> list[StepEvent]:
        assert self.done.wait(120), f"no last event; got {len(self.events)} events"
        return self.events


def test_steps_in_order_then_the_plain_final_image(pipe):
    engine = SequentialStreamEngine(pipe)
    try:
        got = Collector()
        engine.submit(request(steps=5), got, lambda: False, preview_every=2)
        events = got.wait()
    finally:
        engine.close()
    assert [e.step for e in events] == [1, 2, 3, 4, 5, 5] and all(e.total == 5 for e in events)
    assert [e.preview is not None for e in events[:-1]] == [False, True, False, True, False]
    assert events[-1].final is not None and events[-1].error is None and not any(e.last for e in events[:-1])
    np.testing.assert_array_equal(events[-1].final, pipe.generate(request(steps=5)))


def test_previews_are_the_reference_clean_image_predictions(pipe, ckpt):
    steps, req = 4, request(steps=4, seed=9)
    engine = SequentialStreamEngine(pipe)
    try:
        got = Collector()
        engine.submit(req, got, lambda: False, preview_every=1)
        events = got.wait()
    finally:
        engine.close()
    preds: list[torch.Tensor] = []
    x_ref = ref.reference_generate(ref.RefModel(ckpt), req.cond_kv, req.uncond_kv, 12, 3, H, W, req.noise, steps,
                                   req.sampling.timestep_shift, 4.0, req.sampling.cfg_interval, "global", True,
                                   previews=preds)
    assert len(preds) == steps
    for event, pred in zip(events[:-1], preds):
        diff = np.abs(event.preview.astype(int) - ref.reference_pixels(pred).astype(int))
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (event.step, diff.max(), (diff > 0).mean())
    # the first preview is far from the last: previews really follow the run
    assert np.abs(events[0].preview.astype(int) - events[-2].preview.astype(int)).mean() > 5
    # the last step reaches t = 1, where the prediction is the final state itself
    diff = np.abs(events[-2].preview.astype(int) - ref.reference_pixels(x_ref).astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01


def test_cancellation_stops_between_steps(pipe):
    engine = SequentialStreamEngine(pipe)
    try:
        got = Collector()
        engine.submit(request(steps=50), got, lambda: len(got.events) >= 2)
        events = got.wait()
        after = Collector()
        engine.submit(request(steps=2), after, lambda: False)  # the engine goes on
        assert after.wait()[-1].final is not None
    finally:
        engine.close()
    assert [e.step for e in events[:-1]] == [1, 2]
    assert isinstance(events[-1].error, GenerationCancelled) and events[-1].final is None


def test_fifo_queue_callbacks_and_a_failing_emit(pipe):
    waits, batches, step_times = [], [], []
    engine = SequentialStreamEngine(pipe, on_queue_wait=waits.append, on_batch=batches.append,
                                    on_step_time=step_times.append)
    finished: list[int] = []
    try:
        jobs = [Collector(fail_on_step=(i == 0), order=finished, name=i) for i in range(3)]
        for i, job in enumerate(jobs):
            engine.submit(request(steps=3, seed=i), job, lambda: False)
        for job in jobs:
            events = job.wait()
            assert events[-1].final is not None, events[-1].error  # emit raising does not end a request
    finally:
        engine.close()
    assert finished == [0, 1, 2]
    assert len(waits) == 3 and all(w >= 0 for w in waits) and batches == [1, 1, 1]
    assert len(step_times) == 9 and all(s > 0 for s in step_times)
    np.testing.assert_array_equal(jobs[2].events[-1].final, pipe.generate(request(steps=3, seed=2)))


def test_close_cancels_running_and_queued_requests(pipe):
    engine = SequentialStreamEngine(pipe)
    started = threading.Event()
    running, queued = Collector(), Collector()
    engine.submit(request(steps=200), lambda e: (started.set(), running(e)), lambda: False)
    engine.submit(request(steps=2), queued, lambda: False)
    assert started.wait(60)
    engine.close()
    for job in (running, queued):
        events = job.wait()
        assert sum(e.last for e in events) == 1 and isinstance(events[-1].error, GenerationCancelled)
    assert len(running.events) < 200
    late = Collector()
    engine.submit(request(steps=2), late, lambda: False)
    assert isinstance(late.wait()[-1].error, GenerationCancelled)
