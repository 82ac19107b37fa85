"""The soak harness's bookkeeping without a server: outcome labels, the session flood's pacing, the
summary and the goals (testing.mixed_traffic, testing.attacks, testing.attack_soak)."""

from __future__ import annotations

import threading

from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from neopp.launcher.door.grpc_stream import stream_error
from testing.attack_soak import goals, summary, watchdog_actions
from testing.attacks import SessionFlood
from testing.faults import wait_for
from testing.mixed_traffic import Outcome, grpc_label, http_label


def test_outcomes_are_labelled_by_what_a_client_can_do_with_them():
    full = InferenceServerException("[request id: <id_unknown>] Exceeds maximum queue size", "StatusCode.UNAVAILABLE")
    assert grpc_label(full)[0] == "refused"
    assert grpc_label(InferenceServerException("Stub process 'x' is not healthy.", "StatusCode.INTERNAL"))[0] == \
        "server-error"
    assert grpc_label(InferenceServerException("COND_KV: bad", "StatusCode.INVALID_ARGUMENT"))[0] == "client-error"
    # a stream's errors carry no status: the front's refusal says to retry, another is the server's
    refusal = stream_error(pb.ModelInferRequest(model_name="m"), "this client has 32 generation(s) running")
    text = pb.ModelStreamInferResponse.FromString(refusal).error_message
    assert grpc_label(InferenceServerException(text))[0] == "refused"
    assert grpc_label(InferenceServerException("COND_KV: bad"))[0] == "client-error"
    assert grpc_label(InferenceServerException("internal error: x"))[0] == "server-error"
    assert grpc_label(InferenceServerException("failed to connect to all addresses",
                                               "StatusCode.UNAVAILABLE"))[0] == "transport"
    assert http_label(429, {"Retry-After": "1"}, b"")[0] == "refused"
    assert http_label(503, {}, b"busy")[0] == "refused-without-retry-after"
    assert http_label(500, {}, b"boom") == ("server-error", "HTTP 500: boom")


def test_the_session_flood_keeps_trying_at_its_pace():
    opened, gate = [], threading.Event()

    def open_session(sid: int) -> None:
        if len(opened) >= 3:
            gate.set()
            raise InferenceServerException("session limit reached: ...", "StatusCode.UNAVAILABLE")
        opened.append(sid)

    flood = SessionFlood(open_session, first_id=10, pause_s=0.01, threads=1).start()
    assert wait_for(lambda: sum(v for k, v in flood.counts.items() if k.startswith("refused")) >= 3, timeout=10)
    counts = flood.stop()
    assert opened == [11, 12, 13] and counts["opened"] == 3 and gate.is_set()


def test_the_goals_read_the_report():
    fine = [Outcome("grpc", 0.0, 0.1, "ok"), Outcome("v1", 0.0, 0.3, "refused", "HTTP 429: x")]
    base = summary(fine, 0, 10.0)
    report = {"baseline": base, "attack": {**summary(fine, 0, 10.0),
                                           "health_live": {"p99_ms": 20.0, "answers": {"200": 40}},
                                           "health_floor": {"p99_ms": 15.0, "answers": {"200": 40}}},
              "stub_kill": {"serving_again_s": 8.0, "actions": watchdog_actions(
                  "neopp watchdog: neopp_dense: no live stub for ['neopp_dense_0_0']; reloading the model\n")},
              # four instances each; the killed model's reload replaced all four
              "stubs_during_attack": {"neopp_dense": {"at_start": 4, "seen": 8, "lost": 4, "alive": 4},
                                      "neopp_t2i": {"at_start": 4, "seen": 4, "lost": 0, "alive": 4}},
              "attacks_sent": {"grpc-abuse": {"no message: INVALID_ARGUMENT": 9, "unread streams": 2}}}
    assert all(held for _, held in goals(report))
    slow_and_failing = [*fine, Outcome("grpc", 0.0, 5.0, "ok"), Outcome("grpc", 0.0, 9.0, "server-error", "gRPC x")]
    report["attack"] = {**summary(slow_and_failing, 0, 10.0),
                        "health_live": {"p99_ms": 900.0, "answers": {"200": 3, "503": 9}},
                        "health_floor": {"p99_ms": 500.0, "answers": {"200": 12}}}
    assert [held for _, held in goals(report)] == [False, False, True, True, False, False]
    report["attack"]["health_floor"]["p99_ms"] = 600.0  # a busier machine: 900 ms is its floor's 1.5x
    assert [held for _, held in goals(report)][4:] == [False, True]
    report["attacks_sent"]["grpc-abuse"]["garbage: deadline"] = 1  # a call left unanswered
    assert not goals(report)[3][1]
    report["stubs_during_attack"]["neopp_t2i"] = {"at_start": 4, "seen": 5, "lost": 1, "alive": 4}  # one replaced
    assert not goals(report)[2][1]
    report["stubs_during_attack"]["neopp_dense"] = {"at_start": 4, "seen": 12, "lost": 8, "alive": 4}  # reloaded twice
    assert not goals(report)[2][1]
    report["stubs_during_attack"]["neopp_dense"] = {"at_start": 4, "seen": 7, "lost": 4, "alive": 3}  # one missing
    assert not goals(report)[2][1]
    report["stubs_during_attack"]["neopp_dense"] = {"at_start": 4, "seen": 8, "lost": 4, "alive": 4}
    report["stubs_during_attack"]["neopp_t2i"] = {"at_start": 4, "seen": 4, "lost": 0, "alive": 4}
    report["stub_kill"]["actions"] = watchdog_actions("neopp watchdog: x: y; killing its stub 7 (SIGKILL)")
    assert not goals(report)[2][1]  # the watchdog killed a stub of its own accord


def test_the_process_probe_measures_the_floor_server_from_its_own_process_until_stopped():
    import os

    from testing.probe_process import FloorServer, ProcessProbe

    floor = FloorServer()
    try:
        probe = ProcessProbe(floor.port, interval_s=0.05).start()
        assert probe._proc is not None and probe._proc.pid != os.getpid()
        wait_for(lambda: probe._proc.poll() is None, timeout=10)
        threading.Event().wait(0.5)
        probe.stop()
    finally:
        floor.stop()
    assert floor._proc.poll() is not None  # stopped by its process id
    assert probe.statuses.get("200", 0) >= 2 and set(probe.statuses) == {"200"}
    assert len(probe.latencies) == sum(probe.statuses.values()) and all(0 <= t < 30 for t in probe.latencies)
