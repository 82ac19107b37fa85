"""The one step scheduler, on its own: admission within the budget, no head-of-line blocking,
the right of way of a request that waited long enough, cancellation and close.

Jobs are numbers and costs a table, so every rule is checked exactly, step by step.
"""

from __future__ import annotations

import pytest

from neopp.engines.scheduler import Decision, Scheduler


def run(scheduler: Scheduler, active: list[int], costs: dict[int, int]) -> Decision:
    return scheduler.decide(active, costs.__getitem__)


def test_requests_join_in_arrival_order_while_the_budget_allows():
    s = Scheduler(budget=10)
    for job in (1, 2, 3):
        s.enqueue(job)
    assert run(s, [], {1: 4, 2: 4, 3: 4}) == Decision(admit=(1, 2))
    assert s.queue == [3]
    assert run(s, [1, 2], {1: 4, 2: 4, 3: 4}) == Decision()  # still full
    assert run(s, [2], {2: 4, 3: 4}) == Decision(admit=(3,))  # 1 left: 3 fits


def test_a_small_request_behind_a_large_one_starts_at_the_next_step():
    s = Scheduler(budget=10)
    s.enqueue(1)
    assert run(s, [], {1: 8}) == Decision(admit=(1,))
    s.enqueue(2)  # large: waits for budget
    s.enqueue(3)  # small: passes it
    assert run(s, [1], {1: 8, 2: 6, 3: 2}) == Decision(admit=(3,))
    assert s.queue == [2]


def test_a_request_larger_than_the_budget_runs_alone():
    s = Scheduler(budget=10, patience=0)
    s.enqueue(1)
    s.enqueue(2)
    assert run(s, [], {1: 50, 2: 1}) == Decision(admit=(1,))  # alone, and nothing joins it
    assert run(s, [1], {1: 50, 2: 1}) == Decision()
    assert run(s, [], {2: 1}) == Decision(admit=(2,))


def test_the_oldest_blocked_request_gets_the_right_of_way_after_patience_steps():
    costs = {1: 6, 2: 6, 3: 3, 4: 3, 5: 3}
    s = Scheduler(budget=10, patience=2)
    s.enqueue(1)
    assert run(s, [], costs) == Decision(admit=(1,))
    s.enqueue(2)  # does not fit beside 1
    s.enqueue(3)
    assert run(s, [1], costs) == Decision(admit=(3,))  # 2 waits 1 step, 3 passes
    s.enqueue(4)
    assert run(s, [1, 3], costs) == Decision()  # 2 has waited 2 steps: its right of way from now on
    assert run(s, [1], costs) == Decision()  # 3 left: 4 would fit, but 2 is first
    assert run(s, [], costs) == Decision(admit=(2, 4))  # 1 left: 2 starts, 4 fits beside it


def test_strict_arrival_order_with_no_patience():
    s = Scheduler(budget=10, patience=0)
    s.enqueue(1)
    assert run(s, [], {1: 8}) == Decision(admit=(1,))
    s.enqueue(2)
    s.enqueue(3)
    assert run(s, [1], {1: 8, 2: 6, 3: 2}) == Decision()  # 3 would fit, but does not pass 2


def test_cancellations_leave_at_the_boundary_queued_or_running():
    s = Scheduler(budget=10)
    for job in (1, 2, 3):
        s.enqueue(job)
    assert run(s, [], {1: 4, 2: 4, 3: 4}) == Decision(admit=(1, 2))
    s.cancel(1)
    s.cancel(3)
    s.cancel(99)  # gone already: nothing to stop
    assert run(s, [1, 2], {1: 4, 2: 4, 3: 4}) == Decision(drop=(1, 3))
    assert s.queue == [] and not s.cancelled


def test_close_stops_everything():
    s = Scheduler(budget=10)
    s.enqueue(1)
    s.close()
    assert run(s, [2], {1: 1, 2: 1}) == Decision(stop=True)


@pytest.mark.parametrize("budget, patience", [(0, 1), (10, -1)])
def test_settings_are_checked(budget, patience):
    with pytest.raises(ValueError):
        Scheduler(budget, patience)


# ---- turns between client lanes

def test_a_client_with_nothing_running_goes_before_another_client_s_backlog():
    s = Scheduler(budget=4)
    for job in range(1, 9):
        s.enqueue(job, "heavy")
    s.enqueue(100, "light")  # arrives last
    costs = {job: 2 for job in (*range(1, 9), 100)}
    assert run(s, [], costs) == Decision(admit=(1, 100))  # one of each lane, in turn


def test_lanes_take_turns_starting_after_the_lane_served_last():
    s = Scheduler(budget=1, patience=100)  # one request a step: the order of turns is the order of starts
    for job, lane in ((1, "a"), (2, "a"), (3, "a"), (4, "b"), (5, "b"), (6, "c")):
        s.enqueue(job, lane)
    costs = dict.fromkeys(range(1, 7), 1)
    started = []
    for _ in range(6):
        decision = run(s, [], costs)
        started += decision.admit
    assert started == [1, 4, 6, 2, 5, 3]
    assert s.lanes == {}  # no lane is remembered for a job that left


def test_one_lane_keeps_arrival_order_and_cancelled_jobs_leave_their_lane():
    s = Scheduler(budget=2)
    for job in (1, 2, 3):
        s.enqueue(job, "only")
    s.cancel(2)
    assert run(s, [], dict.fromkeys((1, 2, 3), 1)) == Decision(admit=(1, 3), drop=(2,))
    assert s.lanes == {}
