"""Offline rules behind the reliability suites: request byte limit, positive SIZE, instance names,
the launcher's restart rate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neopp.errors import InputError
from neopp.launcher.supervisor import RestartRate
from neopp.launcher.watchdog import expected_instances
from neopp.limits import Limits
from neopp.serving.request_parsing import parse_request


def _inputs(**extra):
    return {"COND_KV": torch.zeros(2, 2, 10, 2, 32, dtype=torch.bfloat16),
            "INDEX_OFFSET_COND": np.array([1], np.int64), **extra}


def test_request_bytes_count_every_input():
    kv_bytes = 2 * 2 * 10 * 2 * 32 * 2
    parse_request(_inputs(), Limits(max_request_bytes=kv_bytes + 8))
    with pytest.raises(InputError, match=rf"^RNG_STATE: .*max_request_bytes={kv_bytes + 8}"):
        parse_request(_inputs(RNG_STATE=np.zeros(kv_bytes * 2, np.uint8)), Limits(max_request_bytes=kv_bytes + 8))
    with pytest.raises(InputError, match="^TASK: "):
        parse_request(_inputs(TASK=np.array([b"x" * 10**5], np.object_)), Limits(max_request_bytes=kv_bytes + 1000))


@pytest.mark.parametrize("size", [(-32, 64), (64, 0), (-(2**63), 32)])
def test_non_positive_size_is_an_input_error(size):
    with pytest.raises(InputError, match=r"^SIZE: .*positive multiple of 32"):
        parse_request(_inputs(SIZE=np.array(size, np.int64)), Limits())


def test_expected_instance_names():
    assert expected_instances({"name": "m", "instance_group": [{"name": "m_0", "count": 2}]}) == ["m_0_0", "m_0_1"]
    assert expected_instances({"name": "m", "instance_group": [{"count": 1, "gpus": [0, 1]}]}) == ["m_0_0", "m_0_1"]


def test_a_generation_stub_drops_the_servers_malloc_tuning():
    """The variables leave the stub's environment (its rank workers start without them)."""
    import os
    import subprocess
    import sys

    from neopp.launcher.triton_install import MALLOC_ENV

    code = ("import os; from neopp.procs import restore_malloc_defaults; restore_malloc_defaults(); "
            "print(sorted(k for k in os.environ if k.startswith('MALLOC_')))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **MALLOC_ENV}, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    assert out.strip() == "[]"


def test_restarts_are_a_rate_not_a_lifetime_budget():
    now = [0.0]
    rate = RestartRate(limit=3, window_s=600.0, clock=lambda: now[0])
    assert [rate.allow() for _ in range(4)] == [True, True, True, False]  # a crash loop is given up on
    now[0] = 601.0  # ten minutes later the old restarts no longer count
    assert [rate.allow() for _ in range(4)] == [True, True, True, False]
    rare = RestartRate(limit=3, window_s=600.0, clock=lambda: now[0])
    for _ in range(20):  # one crash every five minutes is restarted forever
        now[0] += 300.0
        assert rare.allow(), "a rare crash was not restarted"


def test_a_stop_timeout_gives_triton_the_same_exit_timeout():
    """--stop-timeout-s: running requests get that long at a stop, and tritonserver waits as long."""
    import argparse

    from neopp.launcher.serve_options import add_arguments
    from neopp.launcher.supervisor import server_args

    parser = argparse.ArgumentParser()
    add_arguments(parser, "model_repository", "build/admin.key", "")
    ns = parser.parse_args(["--stop-timeout-s", "600", "--", "--model-control-mode=explicit"])
    assert server_args(ns, ns.extra[1:]) == ["--model-control-mode=explicit", "--exit-timeout-secs=600"]
    given = parser.parse_args(["--stop-timeout-s", "600", "--", "--exit-timeout-secs=90"])
    assert server_args(given, given.extra[1:]) == ["--exit-timeout-secs=90"]
    plain = parser.parse_args([])
    assert plain.stop_timeout_s is None and server_args(plain, []) == []


def test_a_request_given_up_by_its_waiter_is_cancelled_in_the_engine():
    """generate_by_waiting's timeout tells the engine to drop the request at its next step."""
    from neopp.engines.engine import generate_by_waiting
    from neopp.errors import WorkerFailure

    seen = {}

    def submit(req, emit, cancelled):  # an engine that never answers
        seen["cancelled"] = cancelled

    with pytest.raises(WorkerFailure, match="no answer within"):
        generate_by_waiting(submit, None, None, None, timeout_s=0.01)
    assert seen["cancelled"]() is True


def test_the_lightllm_client_goes_stateless_only_when_the_server_lost_the_session():
    import sys

    from testing import REPO

    sys.path.insert(0, str(REPO / "client_examples"))
    from lightllm_client import NeoPPTritonClient, session_unknown, unavailable
    from tritonclient.utils import InferenceServerException

    def err(status: str, message: str) -> InferenceServerException:
        return InferenceServerException(msg=message, status=status)

    assert session_unknown(err("StatusCode.NOT_FOUND", "sequence_id 7: unknown session (expired after 600 s idle)"))
    assert not session_unknown(err("StatusCode.NOT_FOUND", "Request for unknown model: 'neopp_dense' is not found"))
    assert unavailable(err("StatusCode.UNAVAILABLE", "Stream removed"))
    assert not unavailable(err("StatusCode.UNAVAILABLE", "Exceeds maximum queue size"))
    client = NeoPPTritonClient("127.0.0.1:1", sequence_id=5)  # no call is made
    client.stateless, client.model = True, "neopp_dense"  # as after a session was lost
    client.new_session(6)
    assert (client.stateless, client.model, client.sequence_id) == (False, "neopp_session", 6)
    client.client.close()


def test_a_model_is_hung_only_while_requests_wait_and_nothing_moves():
    from neopp.launcher.watchdog import HangWatch

    watch = HangWatch(hung_s=10.0)
    busy = [watch.update(t, {"m": (3.0, 5.0)}, {"m": t * 0.5}) for t in range(0, 40, 2)]
    assert not any(busy), "a stub computing (its CPU advancing) is never hung, however long it takes"
    waiting = [watch.update(t, {"bls": (2.0, 0.0), "m": (0.0, float(t))}, {"bls": 0.0}) for t in range(40, 80, 2)]
    assert not any(waiting), "a session stub waiting on a model that steps is not hung"
    idle = [watch.update(t, {"m": (0.0, 80.0)}, {"m": 0.0}) for t in range(80, 120, 2)]
    assert not any(idle), "nothing waiting: nothing to judge"
    stuck = [watch.update(t, {"m": (1.0, 80.0), "other": (0.0, 9.0)}, {"m": 0.02 * t}) for t in range(120, 134, 2)]
    assert stuck[:5] == [[]] * 5 and stuck[5] == ["m"], stuck  # 10 s waiting, no progress, no CPU of its own


def test_health_says_why_the_server_or_a_model_cannot_serve_now():
    from neopp.launcher.health import ServerHealth

    health = ServerHealth()
    assert health.not_ready() == "tritonserver is starting" == health.model_unavailable("m")
    health.server_up()
    assert health.not_ready() is None and health.model_unavailable("m") is None
    health.model_broken("m", "no live stub for ['m_0_0']")
    assert health.model_unavailable("other") is None
    assert health.not_ready() == health.model_unavailable("m") == "m: no live stub for ['m_0_0']"
    health.model_serving("m")
    assert health.not_ready() is None
    health.request_restart("first")
    health.request_restart("second")
    assert health.take_restart() == "first" and health.take_restart() is None


def test_failed_reloads_back_off_then_the_server_is_restarted():
    """A model with no live stub is reloaded; reloads that fail are retried after 2, 4 s, and the
    third failure in a row hands over to the supervisor (a restart of tritonserver)."""
    import os

    from neopp.launcher.watchdog import StubWatchdog

    class Server:  # the model-repository API of a server whose loads fail
        loads: list[float] = []

        def get_model_repository_index(self, **_):
            return {"models": [{"name": "m", "state": "READY"}]}

        def get_model_config(self, model, **_):
            return {"config": {"name": model, "backend": "python"}}

        def load_model(self, model, **_):
            Server.loads.append(now[0])
            raise RuntimeError("load failed")

    now, notes = [0.0], []
    dog = StubWatchdog(Server(), os.getpid(), log=notes.append, clock=lambda: now[0])  # no stub below us
    for t in (0.0, 1.5, 2.0, 3.6, 7.0, 8.1, 20.0):  # each death waits out the 1 s grace, then the backoff
        now[0] = t
        dog.check_once()
    assert Server.loads == [1.5, 3.6, 8.1], notes
    assert dog.health.model_unavailable("m") is not None
    assert dog.health.take_restart() == "3 reloads of m failed in a row"


def test_a_request_that_ran_while_the_server_recovered_is_told_so():
    from neopp.launcher.health import ServerHealth

    now = [10.0]
    health = ServerHealth(clock=lambda: now[0])
    health.server_up()
    sent = 11.0
    now[0] = 12.0
    health.model_broken("m", "reloading")
    now[0] = 13.0
    health.model_serving("m")  # ready again at 13 s
    assert health.not_ready() is None and health.not_ready(since=14.0) is None
    assert health.not_ready(since=sent) == "it was recovering while this request ran"


class ReloadingRepository:
    """The model-repository API of a server whose one Python model reloads fine."""

    def get_model_repository_index(self, **_):
        return {"models": [{"name": "m", "state": "READY"}]}

    def get_model_config(self, model, **_):
        return {"config": {"name": model, "backend": "python"}}

    def load_model(self, model, **_):
        pass


def test_stubs_of_replaced_instances_still_running_after_a_reload_are_ended():
    """Stubs that ran before a reload and still run ``leftover_s`` after it are ended (by pid and
    start time); one that left by itself, and any process started since, are not touched."""
    import subprocess
    import sys

    from neopp.launcher.watchdog import StubWatchdog
    from neopp.procs import start_ticks

    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        now, notes = [0.0], []
        dog = StubWatchdog(ReloadingRepository(), leftover.pid, log=notes.append, clock=lambda: now[0], leftover_s=15.0)
        dog._leftovers.append((15.0, "m", [(leftover.pid, start_ticks(leftover.pid)), (gone.pid, 1)]))
        now[0] = 14.0
        dog._end_leftovers(now[0])
        assert leftover.poll() is None, notes  # not yet due
        now[0] = 15.0
        dog._end_leftovers(now[0])
        assert leftover.wait(10) == -9, notes
        assert any(f"stub {leftover.pid} of a replaced instance" in n for n in notes), notes
        assert dog._leftovers == [] and dog.health.take_restart() is None
    finally:
        leftover.kill()
        leftover.wait()


def test_a_reload_remembers_the_model_s_stubs_from_before_it():
    import os

    from neopp.launcher.watchdog import StubWatchdog

    now = [0.0]
    dog = StubWatchdog(ReloadingRepository(), os.getpid(), log=lambda _: None, clock=lambda: now[0], leftover_s=15.0)
    dog._reload("m", ["m_0_0"])
    assert dog._leftovers == [(15.0, "m", [])]  # no stub of m below this process
