"""Sessions that are started and never ended cannot lock out a new one, through the real server.

The private repository gives Triton 4 sequence slots and the model 2 sessions: without the
model ending dropped sessions in Triton, the fifth start would wait in Triton's backlog for the
whole idle bound (600 s here)."""

from __future__ import annotations

import re
import time
import urllib.request

import numpy as np
import pytest
from small_repo import SmallServer, write_repo
from tritonclient.utils import InferenceServerException

SESSION = "neopp_session"
MAX_SESSIONS, CANDIDATES = 2, 4
LIMIT_S = 60.0  # per request; a locked-out start would wait 600 s


@pytest.fixture(scope="module")
def small(tiny_dense, tmp_path_factory):
    root = tmp_path_factory.mktemp("lockout")
    repo = write_repo(root, {"max_sessions": str(MAX_SESSIONS), "session_idle_timeout_s": "600"}, CANDIDATES)
    server = SmallServer(repo, tiny_dense, root / "tritonserver.log").start()
    try:
        yield server
    finally:
        assert not server.stop(), "tritonserver left processes behind"


TOKENS: dict[int, tuple[np.ndarray, str]] = {}  # each opened session's SESSION_TOKEN


def start(s: SmallServer, sid: int, **overrides):
    result = s.grpc.infer(SESSION, s.tensors(**overrides), sequence_id=sid, sequence_start=True,
                          client_timeout=LIMIT_S)
    TOKENS[sid] = (np.array([result.as_numpy("SESSION_TOKEN")[0]], np.object_), "BYTES")
    return result


def close(s: SmallServer, sid: int) -> None:
    """The owner's sequence_end without an image."""
    inputs = s.tensors(**{name: None for name in ("COND_KV", "UNCOND_KV", "INDEX_OFFSET_COND", "INDEX_OFFSET_UNCOND",
                                                  "SIZE", "STEPS", "OUTPUT_FORMAT")}, SESSION_TOKEN=TOKENS[sid])
    s.grpc.infer(SESSION, inputs, sequence_id=sid, sequence_end=True, client_timeout=LIMIT_S)


def active_sessions(s: SmallServer) -> float:
    text = urllib.request.urlopen(s.server.metrics_url, timeout=10).read().decode()
    return sum(float(v) for labels, v in re.findall(r"^neopp_sessions_active\{([^}]*)\} (\S+)$", text, re.M)
               if f'model="{SESSION}"' in labels)


def test_sessions_never_ended_do_not_lock_out_a_new_one(small):
    opened = list(range(100, 100 + 3 * CANDIDATES))
    for sid in opened:  # each start must be served, never parked in the backlog
        assert int(start(small, sid).as_numpy("TURN")[0]) == 0
        assert active_sessions(small) <= MAX_SESSIONS
    began = time.monotonic()
    fresh = start(small, 999)
    assert int(fresh.as_numpy("TURN")[0]) == 0 and time.monotonic() - began < 30
    assert small.grpc.is_server_ready() and small.grpc.is_model_ready(SESSION)
    # The newest sessions are still served; the model's own count stays at its bound.
    assert int(small.grpc.infer(SESSION, small.tensors(SESSION_TOKEN=TOKENS[opened[-1]]), sequence_id=opened[-1],
                                client_timeout=LIMIT_S).as_numpy("TURN")[0]) == 1
    assert active_sessions(small) == MAX_SESSIONS


def test_failed_first_turns_hold_no_session_and_no_slot(small):
    for sid in (999, 100 + 3 * CANDIDATES - 1):  # end what the previous test left open
        close(small, sid)
    assert active_sessions(small) == 0
    for sid in range(2000, 2000 + 3 * CANDIDATES):
        with pytest.raises(InferenceServerException) as err:
            start(small, sid, INDEX_OFFSET_COND=(np.array([-1], np.int64), "INT64"))
        assert "INDEX_OFFSET_COND" in err.value.message() and "INVALID_ARG" in str(err.value.status())
        assert active_sessions(small) == 0  # a failed first turn leaves no open session
    with pytest.raises(InferenceServerException) as err:  # its next turn must start again
        small.grpc.infer(SESSION, small.tensors(), sequence_id=2000 + 3 * CANDIDATES - 1,
                         client_timeout=LIMIT_S)
    assert "unknown session" in err.value.message() and "sequence_start" in err.value.message()
    assert int(start(small, 3000).as_numpy("TURN")[0]) == 0  # the failed starts hold no slot either
    assert active_sessions(small) == 1
