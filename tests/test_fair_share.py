"""Fair share between sizes in the step loop (neopp.engines.step_loop.fair_turn).

A step takes the requests within one smallest step of the least served. The rule alone is
checked on counts; then a real loop on the tiny model: a small request beside a large one steps
four times for each of the large one's steps, and both still give their solo bytes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from neopp.engines.scheduler import Decision
from neopp.engines.step_loop import Entry, StepLoop, fair_turn
from neopp.sampling.batching import StepBatcher
from testing.stream_requests import assert_pixels_match, make, tiny_setup


def run_turns(costs: dict[str, int], turns: int, served: dict[str, int] | None = None) -> list[set[str]]:
    """Which of ``costs``' requests step at each of ``turns`` steps (each step adds its cost)."""
    reqs = [SimpleNamespace(name=n, served=(served or {}).get(n, 0), cost=c) for n, c in costs.items()]
    out = []
    for _ in range(turns):
        turn = fair_turn(reqs, lambda a: a.cost)
        for a in turn:
            a.served += a.cost
        out.append({a.name for a in turn})
    return out


def test_requests_of_one_size_all_step_every_time():
    assert run_turns({"a": 128, "b": 128, "c": 128}, 5) == [{"a", "b", "c"}] * 5


def test_a_small_request_steps_four_times_for_each_step_of_one_four_times_larger():
    assert run_turns({"small": 128, "large": 512}, 8) == [{"small", "large"}, {"small"}, {"small"}, {"small"}] * 2


def test_near_sizes_stay_batched_and_the_larger_sits_out_now_and_then():
    turns = run_turns({"a": 128, "b": 160}, 40)
    together = sum(t == {"a", "b"} for t in turns)
    assert together >= 30 and all("a" in t for t in turns)  # a is never the one ahead by a step
    assert sum("b" in t for t in turns) * 160 == pytest.approx(40 * 128, abs=160)  # equal shares within a step


def test_a_large_request_is_not_starved_by_small_ones_arriving_at_every_step():
    reqs = [SimpleNamespace(name="large", served=0, cost=512)]
    large_steps = 0
    for step in range(64):
        least = min(a.served for a in reqs)
        reqs.append(SimpleNamespace(name=f"small{step}", served=least, cost=128))  # joins at the least served
        turn = fair_turn(reqs, lambda a: a.cost)
        for a in turn:
            a.served += a.cost
        large_steps += any(a.name == "large" for a in turn)
    assert large_steps >= 64 // 4


def test_an_empty_loop_has_no_turn():
    assert fair_turn([], lambda a: 1) == []


def test_in_the_loop_the_small_one_finishes_first_and_both_keep_their_solo_bytes(tmp_path):
    ckpt, pipe, kvs = tiny_setup(tmp_path)
    small, large = make(kvs, 0, 64, 64, 4, 1), make(kvs, 1, 128, 128, 4, 2)  # 4 and 16 tokens, guided
    solo = [pipe.generate(small), pipe.generate(large)]
    stepped: list[tuple[int, int]] = []
    finals = {}

    def report(job, event):
        stepped.append((job, event.step))
        if event.final is not None:
            finals[job] = event.final
        return True

    loop = StepLoop(pipe, StepBatcher(pipe), report)
    entries = {0: Entry(small), 1: Entry(large)}
    loop.apply(Decision(admit=(0, 1)), entries.__getitem__, entries.get)
    turns = []
    while loop.active:
        before = len(stepped)
        loop.step()
        turns.append({job for job, _ in stepped[before:]})
    assert turns == [{0, 1}, {0}, {0}, {0}, {1}, {1}, {1}]
    assert_pixels_match(finals[0], solo[0], "small")
    assert_pixels_match(finals[1], solo[1], "large")


def test_a_request_joining_later_starts_at_the_least_served(tmp_path):
    ckpt, pipe, kvs = tiny_setup(tmp_path)
    loop = StepLoop(pipe, StepBatcher(pipe), lambda job, event: True)
    entries = {0: Entry(make(kvs, 0, 64, 64, 6, 1)), 1: Entry(make(kvs, 1, 64, 64, 6, 2))}
    loop.apply(Decision(admit=(0,)), entries.__getitem__, entries.get)
    loop.step(), loop.step()
    loop.apply(Decision(admit=(1,)), entries.__getitem__, entries.get)
    assert [a.served for a in loop.active] == [loop.active[0].served] * 2 > [0]


def test_the_benchmark_runs_both_policies_on_the_demo(tmp_path):
    import torch

    from bench import fair_share

    threads = torch.get_num_threads()
    try:
        fair_share.main(["--out", str(tmp_path), "--rounds", "1", "--per-client", "1", "--steps", "2"])
    finally:
        torch.set_num_threads(threads)  # the benchmark leaves its own thread single-threaded, as a stub does
    text = (tmp_path / "fair_share.md").read_text()
    assert "| fair share |" in text and "| all step |" in text and "Mix throughput" in text
