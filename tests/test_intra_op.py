"""Torch's CPU threads belong to the step thread (neopp.engines.intra_op).

Torch copies the process's thread count into a thread at the thread's first question about it.
A stub lowers the process's count to 1 once its engine is built, so the engine's step thread must
have fixed its own count before; a thread that only set it (the control) loses it.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from neopp.engines.batch_engine import BatchingEngine
from neopp.engines.engine import EngineHooks
from neopp.engines.factory import build_engine
from neopp.engines.intra_op import (
    fastest_threads,
    on_passing_thread,
    own_threads,
    single_threaded_here_on,
    thread_counts,
)
from neopp.engines.spec import EngineSpec
from neopp.modes import ModeSpec
from testing.stream_requests import make, tiny_setup


@pytest.fixture
def process_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def count_after_lowering(prepare) -> int:
    """The thread count a thread sees after ``prepare`` ran in it and the process went to 1."""
    prepared, lowered, seen = threading.Event(), threading.Event(), []

    def run() -> None:
        prepare()
        prepared.set()
        lowered.wait(30)
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=run)
    thread.start()
    assert prepared.wait(30)
    single_threaded_here_on()
    lowered.set()
    thread.join(30)
    return seen[0]


def test_a_thread_that_owns_its_count_keeps_it_and_one_that_only_set_it_does_not(process_threads):
    assert count_after_lowering(lambda: own_threads(2)) == 2
    torch.set_num_threads(2)
    assert count_after_lowering(lambda: torch.set_num_threads(2)) == 1  # the control
    assert torch.get_num_threads() == 1  # the lowering thread itself


def test_the_passing_thread_returns_its_result_and_raises_its_failure():
    names = []
    assert on_passing_thread(lambda: names.append(threading.current_thread().name) or 7, "builder") == 7
    assert names == ["builder"] and "builder" not in [t.name for t in threading.enumerate()]
    with pytest.raises(ValueError, match="bad checkpoint"):
        on_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad checkpoint")))


def test_the_step_thread_keeps_its_count_once_the_stub_goes_single_threaded(tmp_path, process_threads):
    ckpt, pipe, kvs = tiny_setup(tmp_path)
    seen: list[int] = []
    hooks = EngineHooks(step_seconds=lambda s: seen.append(torch.get_num_threads()))
    engine = on_passing_thread(lambda: BatchingEngine(pipe, hooks=hooks))
    try:
        single_threaded_here_on()
        engine.generate(make(kvs, 0, 64, 64, 2, 1))
    finally:
        engine.close()
    assert engine.threads == 2 and seen == [2, 2]


def test_the_counts_timed_are_powers_of_two_and_the_cores():
    assert [thread_counts(n) for n in (1, 2, 6, 8)] == [[1], [1, 2], [1, 2, 4, 6], [1, 2, 4, 8]]


def sleeper(cost: dict[int, float]):
    return lambda: time.sleep(cost[torch.get_num_threads()])


def test_the_fastest_count_is_kept_and_a_slow_step_on_every_core_is_not_timed_on_fewer(process_threads):
    best, timings = fastest_threads(sleeper({1: 0.03, 2: 0.01, 4: 0.02}), 4, repeats=1)
    assert best == 2 and torch.get_num_threads() == 2 and sorted(timings) == [1, 2, 4]
    assert timings[2] < timings[4] < timings[1]
    best, timings = fastest_threads(lambda: time.sleep(0.05), 4, repeats=1, slow_s=0.01)
    assert best == 4 and list(timings) == [4]


def test_fewer_threads_must_be_clearly_faster_to_be_chosen(process_threads):
    best, timings = fastest_threads(sleeper({1: 0.019, 2: 0.02}), 2, repeats=1, margin=0.25)
    assert best == 2 and timings[1] < timings[2]  # 5% faster is within the noise of a busy machine
    best, _ = fastest_threads(sleeper({1: 0.01, 2: 0.02}), 2, repeats=1, margin=0.25)
    assert best == 1


def test_an_engine_on_the_cpu_measures_its_count_at_load(tmp_path, process_threads):
    ckpt, pipe, kvs = tiny_setup(tmp_path)
    spec = EngineSpec.local(ckpt, ModeSpec(), "cpu", threads=2, measure_threads=True)
    engine = on_passing_thread(lambda: build_engine(spec))
    try:
        assert sorted(engine.thread_timings) == [1, 2] and all(t > 0 for t in engine.thread_timings.values())
        timings = engine.thread_timings
        assert engine.threads == 2 or timings[engine.threads] < 0.9 * timings[2]  # the rule of fastest_threads
    finally:
        engine.close()
    unmeasured = on_passing_thread(lambda: build_engine(EngineSpec.local(ckpt, ModeSpec(), "cpu", threads=2)))
    unmeasured.close()
    assert unmeasured.thread_timings is None and unmeasured.threads == 2


def test_num_threads_takes_a_count_or_auto():
    from neopp.errors import ConfigError
    from neopp.serving.model_settings import AUTO_THREADS, threads_param

    assert [threads_param(v) for v in ("0", "3", "auto")] == [0, 3, AUTO_THREADS]
    for bad in ("-2", "two", "Auto"):
        with pytest.raises(ConfigError, match="num_threads"):
            threads_param(bad)
