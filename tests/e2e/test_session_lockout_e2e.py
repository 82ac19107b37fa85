"""A flood of new sessions cannot take a held one, nor lock anyone out for good, through the real server.

The private repository gives Triton 4 sequence slots and the model 2 sessions. A full table refuses a
new session at once (gRPC UNAVAILABLE; HTTP 429 with Retry-After through the door) and frees the
sequence slot Triton gave that start: without that, the fifth start would wait in Triton's backlog
for the whole idle bound (600 s here). A held session is never dropped to make room.
"""

from __future__ import annotations

import http.client
import itertools
import json
import re
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient
from small_repo import SmallServer, write_repo
from tritonclient.utils import InferenceServerException

from neopp.launcher.door.body import DoorLimits
from neopp.launcher.door.server import DoorServer
from neopp.ports import LOOPBACK
from testing.faults import wait_for

SESSION = "neopp_session"
MAX_SESSIONS, CANDIDATES = 2, 4
LIMIT_S = 60.0  # per request; a locked-out start would wait 600 s
KV_FREE = ("COND_KV", "UNCOND_KV", "INDEX_OFFSET_COND", "INDEX_OFFSET_UNCOND", "SIZE", "STEPS", "OUTPUT_FORMAT")


@pytest.fixture(scope="module")
def small(tiny_dense, tmp_path_factory):
    root = tmp_path_factory.mktemp("lockout")
    repo = write_repo(root, {"max_sessions": str(MAX_SESSIONS), "session_idle_timeout_s": "600"}, CANDIDATES)
    server = SmallServer(repo, tiny_dense, root / "tritonserver.log").start()
    door = DoorServer(LOOPBACK, 0, server.server.grpc_url, (LOOPBACK, server.server.http_port), "lockout",
                      DoorLimits(region_min_bytes=0)).start()
    server.door_port = door.server_address[1]
    try:
        yield server
    finally:
        door.stop()
        assert not server.stop(), "tritonserver left processes behind"


TOKENS: dict[int, tuple[np.ndarray, str]] = {}  # each opened session's SESSION_TOKEN


def start(s: SmallServer, sid: int, **overrides):
    result = s.grpc.infer(SESSION, s.tensors(**overrides), sequence_id=sid, sequence_start=True,
                          client_timeout=LIMIT_S)
    TOKENS[sid] = (np.array([result.as_numpy("SESSION_TOKEN")[0]], np.object_), "BYTES")
    return result


def close(s: SmallServer, sid: int) -> None:
    """The owner's sequence_end without an image."""
    inputs = s.tensors(**{name: None for name in KV_FREE}, SESSION_TOKEN=TOKENS[sid])
    s.grpc.infer(SESSION, inputs, sequence_id=sid, sequence_end=True, client_timeout=LIMIT_S)


def refused_start(s: SmallServer, sid: int) -> InferenceServerException:
    began = time.monotonic()
    with pytest.raises(InferenceServerException) as err:
        start(s, sid)
    assert time.monotonic() - began < LIMIT_S
    return err.value


def session_metric(s: SmallServer, name: str) -> float:
    text = urllib.request.urlopen(s.server.metrics_url, timeout=10).read().decode()
    return sum(float(v) for labels, v in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)
               if f'model="{SESSION}"' in labels)


def http_start(s: SmallServer, sid: int) -> tuple[int, http.client.HTTPMessage, str]:
    """A first turn over HTTP through the door (binary tensors): status, headers, body."""
    inputs = []
    for name, (arr, dtype) in s.inputs().items():
        tensor = httpclient.InferInput(name, list(arr.shape), dtype)
        tensor.set_data_from_numpy(arr, binary_data=True)
        inputs.append(tensor)
    body, json_size = httpclient.InferenceServerClient.generate_request_body(inputs, sequence_id=sid,
                                                                             sequence_start=True)
    conn = http.client.HTTPConnection(LOOPBACK, s.door_port, timeout=LIMIT_S)
    try:
        conn.request("POST", f"/v2/models/{SESSION}/infer", body,
                     {"Inference-Header-Content-Length": str(json_size), "Content-Type": "application/octet-stream"})
        answer = conn.getresponse()
        return answer.status, answer.headers, answer.read().decode()
    finally:
        conn.close()


def test_a_flood_of_new_sessions_is_refused_at_once_and_takes_no_held_session(small):
    victim = start(small, 100, SEED=(np.array([200], np.int64), "INT64"))
    assert int(victim.as_numpy("TURN")[0]) == 0
    assert int(start(small, 101).as_numpy("TURN")[0]) == 0  # the table is full now
    flood = range(102, 102 + 3 * CANDIDATES)  # more starts than Triton has slots
    for sid in flood:
        err = refused_start(small, sid)
        assert "UNAVAILABLE" in str(err.status()), err
        assert "session limit reached" in err.message() and "max_sessions=2" in err.message()
        assert re.search(r"retry after \d+ s", err.message())
    status, headers, body = http_start(small, 500)  # the same refusal through the HTTP door
    assert status == 429, body
    assert 1 <= int(headers.get("Retry-After", "0")) <= 601 and "session limit reached" in json.loads(body)["error"]
    assert session_metric(small, "neopp_session_starts_refused_total") == len(flood) + 1
    assert session_metric(small, "neopp_sessions_active") == MAX_SESSIONS
    # The victim's next turn continues its stream: the image of the stateless chain.
    turn = small.grpc.infer(SESSION, small.tensors(SESSION_TOKEN=TOKENS[100]), sequence_id=100,
                            client_timeout=LIMIT_S)
    direct = small.grpc.infer("neopp_dense", small.tensors(RNG_STATE=(victim.as_numpy("NEXT_RNG_STATE"), "UINT8")),
                              client_timeout=LIMIT_S)
    assert int(turn.as_numpy("TURN")[0]) == 1
    assert bytes(turn.as_numpy("IMAGE")[0]) == bytes(direct.as_numpy("IMAGE")[0])
    # A session that ends makes room at once.
    close(small, 101)
    began = time.monotonic()
    assert int(start(small, 999).as_numpy("TURN")[0]) == 0 and time.monotonic() - began < 30
    assert small.grpc.is_server_ready() and small.grpc.is_model_ready(SESSION)


def test_failed_first_turns_hold_no_session_and_no_slot(small):
    for sid in (100, 999):  # end what the previous test left open
        close(small, sid)
    assert session_metric(small, "neopp_sessions_active") == 0
    for sid in range(2000, 2000 + 3 * CANDIDATES):
        with pytest.raises(InferenceServerException) as err:
            start(small, sid, INDEX_OFFSET_COND=(np.array([-1], np.int64), "INT64"))
        assert "INDEX_OFFSET_COND" in err.value.message() and "INVALID_ARG" in str(err.value.status())
        assert session_metric(small, "neopp_sessions_active") == 0  # a failed first turn leaves no open session
    with pytest.raises(InferenceServerException) as err:  # its next turn must start again
        small.grpc.infer(SESSION, small.tensors(), sequence_id=2000 + 3 * CANDIDATES - 1,
                         client_timeout=LIMIT_S)
    assert "unknown session" in err.value.message() and "sequence_start" in err.value.message()
    assert int(start(small, 3000).as_numpy("TURN")[0]) == 0  # the failed starts hold no slot either
    assert session_metric(small, "neopp_sessions_active") == 1


def test_a_session_idle_past_its_timeout_makes_room(small):
    idle_s = 3.0
    cfg = small.grpc.get_model_config(SESSION, as_json=True)["config"]
    cfg["parameters"]["session_idle_timeout_s"] = {"string_value": f"{idle_s:g}"}
    small.grpc.load_model(SESSION, config=json.dumps(cfg))  # a fresh table
    try:
        for sid in (4000, 4001):
            start(small, sid)
        err = refused_start(small, 4002)
        assert int(re.search(r"retry after (\d+) s", err.message()).group(1)) <= idle_s + 1
        fresh = itertools.count(4003)

        def admitted_now() -> bool:
            try:
                start(small, next(fresh))
            except InferenceServerException as exc:
                assert "session limit reached" in exc.message(), exc
                return False
            return True

        assert wait_for(admitted_now, timeout=idle_s + LIMIT_S, poll=0.5), "no room after the idle timeout"
        with pytest.raises(InferenceServerException) as gone:
            small.grpc.infer(SESSION, small.tensors(SESSION_TOKEN=TOKENS[4000]), sequence_id=4000,
                             client_timeout=LIMIT_S)
        assert "expired after 3 s idle" in gone.value.message() and "NOT_FOUND" in str(gone.value.status())
    finally:
        small.grpc.load_model(SESSION)  # back to the repository's config
