"""The soak's attack tools against the suite's server and its door (testing.attacks): each does what it
says and leaves nothing open when stopped. Small doses: what the attacks cost a server is measured by
`make soak-attack` (docs/reliability.md), not here."""

from __future__ import annotations

import http.client

from neopp.ports import LOOPBACK
from testing.attacks import IdleConnections, LargeJson, PlantedUnhealthy, TrickledUploads
from testing.faults import wait_for


def door_port(triton) -> int:
    return triton.door.server_address[1]


def live(triton) -> int:
    conn = http.client.HTTPConnection(LOOPBACK, door_port(triton), timeout=30)
    try:
        conn.request("GET", "/v2/health/live")
        return conn.getresponse().status
    finally:
        conn.close()


def test_idle_connections_are_held_then_closed(triton):
    attack = IdleConnections(door_port(triton), n=8).start()
    assert wait_for(lambda: attack.counts["opened"] >= 8, timeout=30)
    assert len(attack._socks) == 8
    counts = attack.stop()
    assert attack._socks == [] and not any(k.startswith("crashed") for k in counts), counts
    assert live(triton) == 200


def test_trickled_uploads_send_a_byte_at_a_time(triton):
    attack = TrickledUploads(door_port(triton), every_s=0.2).start()
    trickled = wait_for(lambda: attack.counts["started"] >= 3 and attack.counts["bytes trickled"] >= 6, timeout=30)
    counts = attack.stop()
    assert trickled, counts
    assert not any(k.startswith(("crashed", "connection error")) for k in counts), counts
    assert live(triton) == 200


def test_large_json_and_planted_texts_are_answered(triton):
    json_attack = LargeJson(door_port(triton), keys=2000).start()
    planted = PlantedUnhealthy(door_port(triton), [("neopp_dense", "neopp_dense_0_0")], every_s=0.1).start()
    assert wait_for(lambda: sum(json_attack.counts.values()) >= 3 and sum(planted.counts.values()) >= 3, timeout=60)
    json_counts, planted_counts = json_attack.stop(), planted.stop()
    assert set(json_counts) == {"answered 400"}, json_counts  # a field the protocol does not have
    assert set(planted_counts) == {"answered 400"}, planted_counts  # not an input of the model
    assert live(triton) == 200
    assert triton.grpc.is_model_ready("neopp_dense")
