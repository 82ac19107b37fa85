"""Fairness between clients, unit by unit: the lane rule every process reads, the door's count
of each client's generations (429 past the limit, labels that name no one) and the lane the door
writes over whatever a client sent. The scheduler's turns are in test_scheduler.py; the whole
path against the real server in tests/e2e/test_client_fairness_e2e.py."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from tritonclient.grpc import service_pb2 as pb

from neopp.contract.client_lanes import PARAMETER, LaneError, lane_of
from neopp.errors import InputError
from neopp.launcher.door.client_load import ClientLoad, Turn
from neopp.launcher.door.door_error import DoorError
from neopp.launcher.door.spliced_request import WireRequest
from neopp.launcher.door.upstream import in_turn
from neopp.serving.lanes import forwarded_lane, request_lane


@pytest.mark.parametrize("value", ["a", "door-0123abcd", "tenant_7:user.3", "x" * 64])
def test_a_lane_that_keeps_the_rule_is_taken(value):
    assert lane_of({PARAMETER: value}) == value
    assert passed_on(json.dumps({PARAMETER: value, "priority": 3})) == {PARAMETER: value}


def passed_on(parameters: str | None) -> dict[str, str]:
    """What a BLS model passes on for a request whose parameters Triton wrote as ``parameters``."""
    class Request:
        def parameters(self) -> str | None:
            return parameters
    return forwarded_lane(Request())


@pytest.mark.parametrize("value", ["", "-a", "x" * 65, "a b", "é", 7, None, ["a"]])
def test_a_lane_that_breaks_the_rule_is_refused_naming_the_parameter(value):
    with pytest.raises(LaneError, match=PARAMETER):
        lane_of({PARAMETER: value})
    with pytest.raises(InputError, match=f"^parameter {PARAMETER}:"):
        request_lane({PARAMETER: value})


def test_no_lane_named_is_the_shared_lane():
    assert lane_of(None) == lane_of({}) == lane_of({"priority": 1}) == ""
    assert passed_on(None) == passed_on("") == passed_on("{}") == {}


def test_a_client_past_its_limit_is_refused_with_retry_after_and_others_are_not():
    load = ClientLoad(limit=3)
    load.take("10.0.0.1", 2)
    load.take("10.0.0.1")
    with pytest.raises(DoorError) as refused:
        load.take("10.0.0.1")
    assert refused.value.status == 429 and refused.value.headers["Retry-After"].isdigit()
    assert "3" in refused.value.message
    load.take("10.0.0.2", 3)  # another client has its own share
    with pytest.raises(DoorError):
        load.take("10.0.0.2", 1)
    load.give("10.0.0.1", 2)
    load.take("10.0.0.1", 2)
    assert load.held == {"10.0.0.1": 3, "10.0.0.2": 3}


def test_a_refused_take_counts_nothing_and_a_full_give_forgets_the_client():
    load = ClientLoad(limit=4)
    load.take("c", 3)
    with pytest.raises(DoorError):
        load.take("c", 2)  # an images request's n: all or nothing
    assert load.held == {"c": 3}
    load.give("c", 3)
    assert load.held == {}


def test_no_limit_means_none():
    load = ClientLoad(limit=0)
    load.take("c", 10_000)
    assert load.look()["limit_per_client"] is None


def test_status_names_no_client_and_the_lane_is_not_the_label():
    load = ClientLoad(limit=8, secret=b"s" * 32)
    for client, count in (("127.0.0.1", 5), ("192.168.7.9", 2), ("::1", 1)):
        load.take(client, count)
    look = load.look()
    text = json.dumps(look)
    assert "127.0.0.1" not in text and "192.168" not in text and "::1" not in text
    assert look["clients"] == 3 and look["in_flight"] == 8 and look["limit_per_client"] == 8
    assert [c["in_flight"] for c in look["busiest"]] == [5, 2, 1]
    label, lane = load.label("127.0.0.1"), load.lane("127.0.0.1")
    assert look["busiest"][0]["client"] == label
    assert label.removeprefix("client-") not in lane and lane_of({PARAMETER: lane}) == lane
    assert ClientLoad(8, secret=b"t" * 32).lane("127.0.0.1") != lane  # a secret of each start


def test_the_door_s_lane_and_priority_replace_the_ones_a_client_sent():
    message = pb.ModelInferRequest(model_name="neopp_dense")
    message.parameters[PARAMETER].string_param = "someone-else"
    message.parameters["priority"].int64_param = 1
    message.parameters["timeout"].uint64_param = 5
    sent = pb.ModelInferRequest.FromString(in_turn(WireRequest(message), Turn("door-abc", 3)).serialize())
    assert sent.parameters[PARAMETER].string_param == "door-abc"
    assert sent.parameters["priority"].WhichOneof("parameter_choice") == "uint64_param"
    assert sent.parameters["priority"].uint64_param == 3
    assert sent.parameters["timeout"].uint64_param == 5


def test_a_client_s_kth_generation_in_flight_gets_priority_k_up_to_the_levels():
    load = ClientLoad(limit=10)
    assert [load.take("a") for _ in range(6)] == [1, 2, 3, 4, 4, 4]
    assert load.take("b", 3) == 1  # an images request's n: the priority of its first
    load.give("a", 6)
    assert load.take("a") == 1
    turn = Turn("door-x", 2)
    assert [turn.nth(i).priority for i in range(4)] == [2, 3, 4, 4]  # an images request's n images


def test_the_call_gate_lets_a_client_run_only_its_share_of_calls_at_once():
    import asyncio

    from neopp.launcher.door.client_load import CallGate

    async def scenario() -> tuple[int, list[str], dict]:
        gate, running, peak, order = CallGate(2), Counter(), Counter(), []

        async def call(client: str, name: str, hold: asyncio.Event) -> None:
            async with gate.slot(client):
                running[client] += 1
                peak[client] = max(peak[client], running[client])
                order.append(name)
                await hold.wait()
                running[client] -= 1

        hold_a, hold_b = asyncio.Event(), asyncio.Event()
        tasks = [asyncio.ensure_future(call("a", f"a{i}", hold_a)) for i in range(5)]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.ensure_future(call("b", "b0", hold_b)))
        await asyncio.sleep(0.01)
        started_before_release = list(order)
        hold_a.set()
        hold_b.set()
        await asyncio.gather(*tasks)
        return peak["a"], started_before_release, dict(gate._lines)

    peak, started, left = asyncio.run(scenario())
    assert peak == 2 and started == ["a0", "a1", "b0"]  # b is not behind a's line
    assert left == {}  # a client with no call left holds nothing
