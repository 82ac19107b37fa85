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
