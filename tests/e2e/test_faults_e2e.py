"""Faults against the real server: a model's Python stub killed (between requests and during
one), the session model restarted, and (on a separate short-lived server) configured limits
and SIGTERM with requests in flight.

Triton 2.51 does not restart a dead stub (the model stays READY and every request fails with
"Stub process ... is not healthy."), so recovery is neopp.launcher.watchdog's job; these tests
run it against the shared server only while they need it.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
from types import SimpleNamespace

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from neopp.launcher.tritonserver import TritonServer
from neopp.launcher.watchdog import StubWatchdog, force_reload
from neopp.procs import model_stubs
from testing import REPO as REPO_ROOT
from testing.faults import kill_own_stub, kill_stub, restart_session_model, sigterm_in_flight, stub_pid, wait_for
from testing.kept_server import KeptServer
from testing.loadgen import image_bytes, infer, valid_inputs

MODEL = "neopp_dense"
EXIT_TIMEOUT_S = 15  # own_server's --exit-timeout-secs: Triton stops a model's stubs one by one, ~1 s each


def _valid(triton, seed: int | None = 3, **change):
    inputs = valid_inputs(triton.cond.float().numpy(), triton.uncond.float().numpy(), (24, 7), seed)
    inputs.update(change)
    return inputs


@pytest.fixture()
def watchdog(triton):
    with StubWatchdog(grpcclient.InferenceServerClient(triton.server.grpc_url), triton.server.process.pid,
                      interval_s=0.25, grace_s=0.5) as dog:
        yield dog


def test_stub_killed_between_requests_is_reloaded(triton, watchdog):
    valid = _valid(triton)
    expected = image_bytes(infer(triton.grpc, MODEL, valid))
    outcome = kill_stub(triton.grpc, triton.server.process.pid, MODEL, valid, expected, timeout=90)
    print(outcome)
    assert outcome.recovery_s is not None and outcome.same_bytes, outcome
    assert all("is not healthy" in e or "not ready" in e or "unavailable" in e.lower()
               for e in outcome.seen_errors), outcome.seen_errors
    assert [r.model for r in watchdog.recoveries] == [MODEL]
    assert model_stubs(triton.server.process.pid, MODEL) not in ([], [outcome.killed_pid])
    assert triton.grpc.is_server_ready() and triton.grpc.is_model_ready(MODEL)


def test_stub_killed_during_request_fails_cleanly_then_recovers(triton, watchdog):
    valid = _valid(triton)
    expected = image_bytes(infer(triton.grpc, MODEL, valid))
    # long steps: the stub is killed in the middle of one (see testing.faults.kill_stub)
    long = _valid(triton, SIZE=(np.array([1024, 1024], np.int64), "INT64"), STEPS=(np.array([100], np.int64), "INT64"))
    outcome = kill_stub(triton.grpc, triton.server.process.pid, MODEL, valid, expected, during=long,
                        metrics_url=triton.server.metrics_url, timeout=90)
    print(outcome)
    # the killed stub is the engine's owner: a request Triton gave that stub fails ("not healthy");
    # one another instance forwarded is sent again to the engine the reload brings back, or, if
    # that engine is not back in time, fails as one to retry (UNAVAILABLE)
    assert outcome.in_flight is not None, outcome
    assert outcome.in_flight == "ok" or "is not healthy" in outcome.in_flight \
        or "UNAVAILABLE" in outcome.in_flight, outcome
    assert outcome.recovery_s is not None and outcome.recovery_s < 60 and outcome.same_bytes, outcome


def test_session_model_restart_refuses_held_sessions(triton):
    """Sessions live in the session model's instance; a restart forgets them, and the next turn
    is refused (Triton's sequence batcher asks for a new START), never continued on a fresh stream."""
    inputs = _valid(triton, seed=200)
    server_pid = triton.server.process.pid

    def kill_and_reload() -> None:
        kill_own_stub(server_pid, stub_pid(server_pid, "neopp_session"))
        force_reload(triton.grpc, "neopp_session")

    for how, restart in (("reload", lambda: force_reload(triton.grpc, "neopp_session")),
                         ("stub killed, then reloaded", kill_and_reload)):
        outcome = restart_session_model(triton.grpc, server_pid, inputs, 4242, restart, how)
        print(outcome)
        assert outcome.first_turn_ok and outcome.restart_ok, outcome
        assert outcome.continued_error is not None, f"{how}: the session was continued after a restart"
        assert "INVALID_ARGUMENT" in outcome.continued_error and "START" in outcome.continued_error, outcome
    triton.grpc.load_model("neopp_session")  # back to config.pbtxt


@pytest.fixture()
def own_server(triton, tmp_path, request):
    """A short-lived server with only neopp_dense (same tiny checkpoint), for what stops a server;
    an indirect parameter sets --exit-timeout-secs (default EXIT_TIMEOUT_S)."""
    exit_timeout = getattr(request, "param", EXIT_TIMEOUT_S)
    env = dict(os.environ, NEOPP_CHECKPOINT=str(triton.checkpoint))
    env = {k: v for k, v in env.items() if not k.startswith("NEOPP_CHECKPOINT_")}
    server = TritonServer(REPO_ROOT / "model_repository", env=env, log_path=tmp_path / "server.log",
                          extra_args=["--model-control-mode=explicit", f"--load-model={MODEL}",
                                      f"--exit-timeout-secs={exit_timeout}"])
    server.start()
    try:
        server.wait_ready(timeout=300)
        yield server
    finally:
        server.stop(timeout=30)


# The mode's default size (1024x1024) must stay within max_side and max_pixels, or loading fails.
LOW_LIMITS = {"max_side": 1536, "max_pixels": 1024 * 1024, "max_prefix_tokens": 30, "max_steps": 6,
              "max_index_offset": 100, "max_request_bytes": 25_000}


def _limit_cases(triton):
    big_kv = np.repeat(triton.cond.float().numpy()[:, :, :1], 31, axis=2)
    return [  # (input changed, value, input named, limit value in the message)
        ("SIZE", (np.array([1568, 32], np.int64), "INT64"), "SIZE", "1536"),
        ("SIZE", (np.array([1056, 1056], np.int64), "INT64"), "SIZE", str(1024 * 1024)),
        ("RESIZE", (np.array([96, 1537], np.int64), "INT64"), "RESIZE", "1536"),
        ("STEPS", (np.array([7], np.int64), "INT64"), "STEPS", "6"),
        ("INDEX_OFFSET_COND", (np.array([101], np.int64), "INT64"), "INDEX_OFFSET_COND", "100"),
        ("COND_KV", (big_kv, "BF16"), "COND_KV", "30"),
        ("UNCOND_KV", (np.repeat(big_kv[:, :, :1], 30, axis=2), "BF16"), "UNCOND_KV", "25000"),
    ]


def test_limits_from_config_are_enforced(triton, own_server, tmp_path):
    """Every limit is a config.pbtxt parameter: lowered ones are refused naming input and limit,
    values at the limits pass."""
    client = grpcclient.InferenceServerClient(own_server.grpc_url)
    http = httpclient.InferenceServerClient(own_server.http_url)
    try:
        config = client.get_model_config(MODEL, as_json=True)["config"]
        config["parameters"].update({k: {"string_value": str(v)} for k, v in LOW_LIMITS.items()})
        # a mode whose default steps stay within the lowered max_steps (a model loads only then)
        mode = json.loads((REPO_ROOT / "configs" / "neopp" / "neopp_dense.json").read_text())
        (tmp_path / "mode.json").write_text(json.dumps({**mode, "infer_steps": LOW_LIMITS["max_steps"]}))
        config["parameters"]["mode_file"] = {"string_value": str(tmp_path / "mode.json")}
        client.load_model(MODEL, config=json.dumps(config))
        at_limit = _valid(triton, SIZE=(np.array([32, 1536], np.int64), "INT64"),
                          STEPS=(np.array([6], np.int64), "INT64"),
                          INDEX_OFFSET_COND=(np.array([100], np.int64), "INT64"))
        assert image_bytes(infer(client, MODEL, at_limit))
        for name, value, named, limit in _limit_cases(triton):
            for c in (client, http):
                with pytest.raises(InferenceServerException) as info:
                    infer(c, MODEL, {**at_limit, name: value})
                message = info.value.message()
                assert info.value.status() in ("StatusCode.INVALID_ARGUMENT", "400"), message
                assert named in message and limit in message, message
                if name == "UNCOND_KV":  # 24 + 30 tokens of 512 B: within max_prefix_tokens, over the bytes
                    assert "max_request_bytes" in message, message
    finally:
        client.close()
        http.close()


# Server alone: an exit timeout far above the work, because when it expires with requests still
# queued (an HTTP client's open connection alone uses it up) Triton 2.51 "exits immediately" and
# was seen to abort in malloc and hang there; TritonServer.stop() escalates to SIGKILL for that.
DRAIN_EXIT_TIMEOUT_S = 240


@pytest.mark.parametrize("own_server,target", [(DRAIN_EXIT_TIMEOUT_S, "server"), (EXIT_TIMEOUT_S, "group")],
                         indirect=["own_server"], ids=["server", "group"])
def test_sigterm_with_requests_in_flight(triton, own_server, target):
    """Each in-flight request gets an image or a clean error, the server exits, and none of its
    processes is left behind. SIGTERM to the server alone: Triton serves on during the exit
    timeout, so every request (even one sent after the signal) is answered and the server exits
    cleanly once they are. SIGTERM to the process group (as a service manager sends it): the
    stubs stop generations between steps, the server exits within the exit timeout.

    The signal goes out only once the server holds every request (queued for an instance or in
    the engine, read from its metrics), so the outcome does not depend on how fast this machine is."""
    def long(side: int, steps: int, seed: int = 3):
        return _valid(triton, seed=seed, SIZE=(np.array([side, side], np.int64), "INT64"),
                      STEPS=(np.array([steps], np.int64), "INT64"))

    # the heaviest request runs first; the others join its batch and none may end before the last
    # is held (256 px, 40 steps: seconds in a batch of six); "group": minutes if not stopped
    longs = [long(512, 60), long(256, 40), long(256, 40)] if target == "server" else [long(512, 200)] * 3
    requests = [long(256, 40, seed=s) for s in range(3)] + longs
    timeout = DRAIN_EXIT_TIMEOUT_S + 60.0
    kinds = itertools.cycle([  # in order of sending: gRPC and HTTP in turn; the late request is gRPC
        lambda: grpcclient.InferenceServerClient(own_server.grpc_url),
        lambda: httpclient.InferenceServerClient(own_server.http_url, network_timeout=timeout)])
    outcome = sigterm_in_flight(own_server, lambda: next(kinds)(), MODEL, requests, answer_timeout=timeout,
                                group=target == "group")
    print(outcome)
    assert outcome.held == len(requests), outcome
    assert outcome.unanswered == 0 and outcome.left_behind == [], outcome
    if target == "server":
        assert outcome.answers == ["ok"] * len(requests) and outcome.late == "ok", outcome
        assert outcome.exit_code == 0 and outcome.stop_s < DRAIN_EXIT_TIMEOUT_S, outcome
        return
    clean = ("error: InferenceServerException", "error: ConnectionRefusedError", "error: ConnectionResetError")
    assert all(a == "ok" or a.startswith(clean) for a in [*outcome.answers, outcome.late]), outcome
    assert any("CANCELLED" in a and "shutting down" in a for a in outcome.answers), outcome
    # a step or two (at the pace measured before the signal), the exit timeout, 30 s to unload
    assert outcome.exit_code is not None, outcome
    assert outcome.stop_s < EXIT_TIMEOUT_S + 2 * outcome.step_s + 30, outcome


def test_a_shared_server_that_dies_comes_back_on_its_ports(triton, own_server):
    """What keeps the suite's shared server up (testing.kept_server), on a server of its own: killed
    hard (as an abort leaves it), it is started again on the same ports and the same client is
    answered the same bytes."""
    holder = SimpleNamespace(server=own_server)
    kept = KeptServer(holder, ready_timeout_s=300).start()
    client = grpcclient.InferenceServerClient(own_server.grpc_url)
    try:
        valid = _valid(triton)
        expected = image_bytes(infer(client, MODEL, valid))
        pid = own_server.process.pid
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: holder.server.process.pid != pid and holder.server.is_ready(), 300, poll=0.5)
        assert image_bytes(infer(client, MODEL, valid)) == expected
        assert kept.restarts == [-signal.SIGKILL]
    finally:
        client.close()
        kept.close()
        for server in kept.servers[1:]:
            server.stop(timeout=30)
