"""The one engine interface: each kind answers both calls, and the two agree.

`generate` blocks until the pixels; `submit` reports each step, then the pixels (or the
error) exactly once. An engine that runs in the caller's thread builds `submit` from its
`generate`; a batching engine builds `generate` from its `submit`.
"""

from __future__ import annotations

import threading

import pytest

from neopp.engines.batch_engine import BatchingEngine
from neopp.engines.factory import build_engine
from neopp.engines.in_process import InProcessEngine
from neopp.engines.spec import EngineSpec
from neopp.errors import GenerationCancelled
from neopp.sampling.sampler import StepEvent
from testing.stream_requests import assert_pixels_match, make, tiny_setup


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    ckpt, pipe, kvs = tiny_setup(tmp_path_factory.mktemp("engines"))
    plain = InProcessEngine(pipe)
    batching = build_engine(EngineSpec.local(ckpt, pipe.mode, "cpu", threads=1))
    yield plain, batching, kvs
    plain.close()
    batching.close()


def test_the_factory_picks_the_engine_and_both_answer_both_calls(engines):
    plain, batching, kvs = engines
    assert isinstance(plain, InProcessEngine) and isinstance(batching, BatchingEngine)
    req = make(kvs, 0, 64, 96, 4, seed=5)
    pixels = plain.generate(req)
    assert_pixels_match(batching.generate(make(kvs, 0, 64, 96, 4, seed=5)), pixels, "batching generate")
    for engine in (plain, batching):
        got: list[StepEvent] = []
        done = threading.Event()

        def emit(event: StepEvent, got=got, done=done) -> None:
            got.append(event)
            if event.last:
                done.set()

        engine.submit(make(kvs, 0, 64, 96, 4, seed=5), emit, lambda: False)
        if engine is plain:
            assert done.is_set(), "the plain engine runs the request in the caller's thread"
        assert done.wait(60)
        assert [e.step for e in got] == [1, 2, 3, 4] and [e.total for e in got] == [4] * 4
        assert [e.last for e in got] == [False] * 3 + [True] and got[-1].error is None
        assert_pixels_match(got[-1].final, pixels, type(engine).__name__)


def test_submit_reports_a_cancellation_as_the_one_last_event(engines):
    plain, _, kvs = engines
    got: list[StepEvent] = []
    plain.submit(make(kvs, 0, 64, 64, 6, seed=2), got.append, lambda: len(got) >= 2)
    assert [e.step for e in got[:-1]] == [1, 2] and isinstance(got[-1].error, GenerationCancelled)
    assert sum(e.last for e in got) == 1
