"""Torch's CPU threads belong to the step thread (neopp.engines.intra_op).

Torch copies the process's thread count into a thread at the thread's first question about it.
A stub lowers the process's count to 1 once its engine is built, so the engine's step thread must
have fixed its own count before; a thread that only set it (the control) loses it.
"""

from __future__ import annotations

import threading

import pytest
import torch

from neopp.engines.batch_engine import BatchingEngine
from neopp.engines.engine import EngineHooks
from neopp.engines.intra_op import on_passing_thread, own_threads, single_threaded_here_on
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
