"""Offline rules behind the reliability suites: request byte limit, positive SIZE, instance names."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neopp.errors import InputError
from neopp.limits import Limits
from neopp.serving.request_parsing import parse_request
from neopp.serving.watchdog import expected_instances


def _inputs(**extra):
    return {"COND_KV": torch.zeros(2, 2, 10, 2, 32, dtype=torch.bfloat16),
            "INDEX_OFFSET_COND": np.array([1], np.int64), **extra}


def test_request_bytes_count_every_input():
    kv_bytes = 2 * 2 * 10 * 2 * 32 * 2
    parse_request(_inputs(), Limits(max_request_bytes=kv_bytes + 8))
    with pytest.raises(InputError, match=r"^RNG_STATE: .*max_request_bytes=%d" % (kv_bytes + 8)):
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
