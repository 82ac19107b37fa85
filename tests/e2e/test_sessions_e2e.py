"""neopp_session through the real server: turns equal chained direct calls and offline replay,
sessions do not disturb each other, seeds restart, bounds hold, errors pass through (a full session table:
test_session_lockout_e2e.py)."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from neopp.tools import replay_kv, replay_kv_multiturn
from testing import REPO as REPO_ROOT
from testing import lightllm_client_module
from testing.pictures import same_pixels
from testing.tiny_checkpoint import random_kv, tiny_config

COND_TOKENS, UNCOND_TOKENS = 24, 7  # the e2e fixture's sample KV lengths, used as offsets

SESSION = "neopp_session"
STEPS = 2
MAX_SESSIONS, IDLE_S = 4, 20.0  # idle limit well above a few turns on a busy machine
SEEDS = (200, None, None)
MODE_FILE = REPO_ROOT / "configs" / "neopp" / "neopp_dense.json"


def _i64(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


@pytest.fixture(scope="module")
def sessions(triton):
    """neopp_session reloaded with small bounds for this module, restored afterwards."""
    cfg = triton.grpc.get_model_config(SESSION, as_json=True)["config"]
    params = cfg.setdefault("parameters", {})
    params["max_sessions"] = {"string_value": str(MAX_SESSIONS)}
    params["session_idle_timeout_s"] = {"string_value": str(IDLE_S)}
    cfg["sequence_batching"]["max_sequence_idle_microseconds"] = "60000000"
    triton.grpc.load_model(SESSION, config=json.dumps(cfg))
    yield triton
    triton.grpc.load_model(SESSION)  # back to config.pbtxt


TOKENS: dict[int, np.ndarray] = {}  # the owner's SESSION_TOKEN of each session id, as its answers carry it


def token_of(sid: int) -> dict[str, np.ndarray]:
    return {"SESSION_TOKEN": TOKENS[sid]} if sid in TOKENS else {}


def turn(t, sid: int, seed: int | None = None, start: bool = False, end: bool = False, **overrides):
    """One turn as the session's owner: it sends back the token the session's answers carry."""
    extra = {"STEPS": _i64(STEPS), **token_of(sid), **overrides}
    if seed is not None:
        extra["SEED"] = _i64(seed)
    result = t.grpc.infer(SESSION, t.grpc_tensors(**extra), sequence_id=sid, sequence_start=start,
                          sequence_end=end, client_timeout=120)
    if result.as_numpy("SESSION_TOKEN")[0]:
        TOKENS[sid] = result.as_numpy("SESSION_TOKEN")
    return result


def session_images(t, sid: int, seeds=SEEDS, end: bool = True) -> list[bytes]:
    out = []
    for i, seed in enumerate(seeds):
        r = turn(t, sid, seed, start=i == 0, end=end and i == len(seeds) - 1)
        assert int(r.as_numpy("TURN")[0]) == i
        out.append(bytes(r.as_numpy("IMAGE")[0]))
    return out


def direct_images(t, seeds=SEEDS) -> list[bytes]:
    """The generation model called directly, the stream chained NEXT_RNG_STATE -> RNG_STATE."""
    out, state = [], None
    for seed in seeds:
        extra = {"STEPS": _i64(STEPS)}
        if seed is not None:
            extra["SEED"] = _i64(seed)
        elif state is not None:
            extra["RNG_STATE"] = state
        r = t.infer_grpc(**extra)
        out.append(bytes(r.as_numpy("IMAGE")[0]))
        state = r.as_numpy("NEXT_RNG_STATE")
    return out


def active_sessions(t) -> float:
    text = urllib.request.urlopen(t.server.metrics_url, timeout=10).read().decode()
    return sum(float(v) for labels, v in re.findall(r'^neopp_sessions_active\{([^}]*)\} (\S+)$', text, re.M)
               if f'model="{SESSION}"' in labels)


def refused(t, sid: int) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        turn(t, sid)
    return info.value


@pytest.fixture(scope="module")
def three_turns(sessions) -> list[bytes]:
    return session_images(sessions, sid=1001)


def test_three_turns_equal_direct_calls_chaining_the_stream(sessions, three_turns):
    assert len(set(three_turns)) == 3  # the stream moves on: three different images
    assert three_turns == direct_images(sessions)


def test_three_turns_equal_offline_multiturn_replay(sessions, three_turns, tmp_path):
    kv = sessions.checkpoint / "sample_kv"
    turns = [f"{kv / 'cond_kv.pt'},{kv / 'uncond_kv.pt'},{COND_TOKENS},{UNCOND_TOKENS},{s if s is not None else 'none'}"
             for s in SEEDS]
    argv = ["--checkpoint", str(sessions.checkpoint), "--mode", str(MODE_FILE), "--size", "64", "64",
            "--steps", str(STEPS), "--output-dir", str(tmp_path), "--output-prefix", "chat"]
    for t in turns:
        argv += ["--turn", t]
    assert replay_kv_multiturn.main(argv) == 0
    assert all(same_pixels((tmp_path / f"chat_{i}.png").read_bytes(), t) for i, t in enumerate(three_turns))


def test_interleaved_sessions_equal_each_alone(sessions):
    seeds_a, seeds_b = (200, None, None), (300, None, None)
    alone_a, alone_b = session_images(sessions, 2001, seeds_a), session_images(sessions, 2002, seeds_b)
    mixed_a, mixed_b = [], []
    for i in range(3):
        for sid, seeds, out in ((2003, seeds_a, mixed_a), (2004, seeds_b, mixed_b)):
            r = turn(sessions, sid, seeds[i], start=i == 0, end=i == 2)
            out.append(bytes(r.as_numpy("IMAGE")[0]))
    assert mixed_a == alone_a and mixed_b == alone_b and alone_a != alone_b


def test_a_turn_with_a_seed_restarts_the_stream(sessions):
    images = session_images(sessions, 3001, (200, None, 201, None))
    assert images[2:] == direct_images(sessions, (201, None))
    assert images[:2] == direct_images(sessions, (200, None))


def test_first_turn_without_seed_uses_the_configured_default(sessions):
    cfg = sessions.grpc.get_model_config(SESSION, as_json=True)["config"]
    default = int(cfg["parameters"]["default_seed"]["string_value"])
    assert session_images(sessions, 3101, (None, None)) == direct_images(sessions, (default, None))


def test_unknown_session_is_refused(sessions):
    err = refused(sessions, 4001)
    assert "START" in err.message() and "StatusCode.INVALID_ARGUMENT" in str(err.status())


def test_expired_session_is_refused(sessions):
    turn(sessions, 4101, 200, start=True)
    time.sleep(IDLE_S + 1.0)
    err = refused(sessions, 4101)
    assert "unknown session" in err.message() and "expired" in err.message()
    assert "NOT_FOUND" in str(err.status())


def test_state_is_freed_at_sequence_end(sessions):
    before = active_sessions(sessions)
    session_images(sessions, 5001, (200, None), end=False)
    assert active_sessions(sessions) == before + 1
    turn(sessions, 5001, end=True)
    assert active_sessions(sessions) == before
    assert "START" in refused(sessions, 5001).message()  # Triton released the sequence too
    # A sequence_end request without KV only closes the session (no image).
    turn(sessions, 5002, 200, start=True)
    closed = sessions.grpc.infer(SESSION, sessions.grpc_tensors(**{n: None for n in sessions.inputs()},
                                                                **token_of(5002)),
                                 sequence_id=5002, sequence_end=True)
    assert int(closed.as_numpy("TURN")[0]) == -1 and closed.as_numpy("IMAGE")[0] == b""
    assert active_sessions(sessions) == before


def test_a_session_belongs_to_the_client_that_holds_its_token(sessions):
    """Another client that knows only the sequence id can neither take a turn, nor end, nor restart
    the session; the owner's next turn is the image it would have been."""
    first = turn(sessions, 5101, 200, start=True)
    token = first.as_numpy("SESSION_TOKEN")
    assert len(token[0]) == 32 and int(token[0], 16) >= 0  # 128 bits, hex
    wrong = {"SESSION_TOKEN": np.array([b"0" * 32], np.object_)}
    attempts = [dict(sequence_id=5101), dict(sequence_id=5101, sequence_start=True),
                dict(sequence_id=5101, sequence_end=True)]
    for kwargs in attempts:
        for stolen in ({"SESSION_TOKEN": None}, wrong):
            with pytest.raises(InferenceServerException) as info:
                sessions.grpc.infer(SESSION, sessions.grpc_tensors(STEPS=_i64(STEPS), SEED=_i64(9), **stolen),
                                    client_timeout=120, **kwargs)
            message = info.value.message()
            # Triton frees the slot at any sequence_end (the model refused it): the next one without
            # START is refused by Triton's sequence batcher before it reaches the model
            ours = "SESSION_TOKEN" in message and "INVALID_ARG" in str(info.value.status())
            assert ours or (stolen is wrong and "sequence_end" in kwargs and "START flag" in message), message
    # Triton's sequence batcher freed the slot at the refused sequence_end; the owner's START with
    # its token continues the session where it was
    second = turn(sessions, 5101, start=True, end=True)
    assert int(second.as_numpy("TURN")[0]) == 1
    assert bytes(second.as_numpy("IMAGE")[0]) == direct_images(sessions, (200, None))[1]


def test_generation_errors_reach_the_client_unchanged(sessions):
    bad = {"INDEX_OFFSET_COND": _i64(-1), "SEED": _i64(1)}
    with pytest.raises(InferenceServerException) as direct:
        sessions.infer_grpc(**bad)
    with pytest.raises(InferenceServerException) as via_session:
        sessions.grpc.infer(SESSION, sessions.grpc_tensors(**bad), sequence_id=7001, sequence_start=True,
                            sequence_end=True)
    assert via_session.value.message() == direct.value.message()
    assert via_session.value.status() == direct.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_an_image_editing_turn_passes_the_image_branch_through(sessions):
    """IMAGE_KV, INDEX_OFFSET_IMAGE and IMAGE_GUIDANCE_SCALE reach the generation model unchanged."""
    edit = {"IMAGE_KV": (random_kv(tiny_config("dense"), 9, seed=4).float().numpy(), "BF16"),
            "INDEX_OFFSET_IMAGE": _i64(9), "IMAGE_GUIDANCE_SCALE": np.array([2.0], np.float32)}
    via_session = turn(sessions, 7002, seed=5, start=True, end=True, **edit)
    direct = sessions.infer_grpc(STEPS=_i64(STEPS), SEED=_i64(5), **edit)
    assert bytes(via_session.as_numpy("IMAGE")[0]) == bytes(direct.as_numpy("IMAGE")[0])
    plain = sessions.infer_grpc(STEPS=_i64(STEPS), SEED=_i64(5))
    assert bytes(plain.as_numpy("IMAGE")[0]) != bytes(direct.as_numpy("IMAGE")[0])


def test_a_model_not_offered_is_refused_naming_model(sessions):
    with pytest.raises(InferenceServerException, match="MODEL: 'neopp_session' is not a generation model"):
        sessions.grpc.infer(SESSION, sessions.grpc_tensors(MODEL=np.array([b"neopp_session"], np.object_)),
                            sequence_id=7101, sequence_start=True, sequence_end=True)


@pytest.mark.parametrize("kv_file", ["cond_kv.pt", "cond_kv.replay.safetensors"])
def test_replay_kv_on_replay_files_equals_the_online_answer(triton, kv_file, tmp_path):
    kv = triton.checkpoint / "sample_kv"
    served = triton.infer_grpc(SEED=_i64(200), STEPS=_i64(STEPS))
    uncond = kv_file.replace("cond_kv", "uncond_kv")
    out = tmp_path / "replayed.png"
    assert replay_kv.main(["--checkpoint", str(triton.checkpoint), "--mode", str(MODE_FILE),
                           "--cond-kv", str(kv / kv_file), "--uncond-kv", str(kv / uncond),
                           "--offset-cond", str(COND_TOKENS), "--offset-uncond", str(UNCOND_TOKENS),
                           "--seed", "200", "--size", "64", "64", "--steps", str(STEPS), "--output", str(out)]) == 0
    assert same_pixels(out.read_bytes(), bytes(served.as_numpy("IMAGE")[0]))  # the served file adds its record


@pytest.mark.parametrize("stateless", [False, True], ids=["session", "stateless"])
@pytest.mark.parametrize("shm", [True, False], ids=["shared-memory", "wire"])
def test_lightllm_client_reproduces_the_three_turns(sessions, three_turns, stateless, shm, tmp_path):
    lightllm = lightllm_client_module()
    import base64

    with lightllm.NeoPPTritonClient(sessions.server.grpc_url, stateless=stateless, shared_memory=shm) as client:
        assert client.use_shm is shm
        client.set_kvcache(sessions.cond, sessions.uncond)
        assert len(client_regions(sessions)) == (1 if shm else 0)  # the KV really travels through shared memory
        client.set_inference_params(COND_TOKENS, UNCOND_TOKENS, infer_steps=STEPS, output_format="png")
        got = []
        for i, seed in enumerate(SEEDS):
            path = tmp_path / f"t{i}.png"
            encoded = client.generate(seed=seed, save_result_path=str(path), target_shape=[64, 64])
            assert base64.b64decode(encoded) == path.read_bytes()
            assert client.last_turn == i
            got.append(path.read_bytes())
    assert got == three_turns
    assert not client_regions(sessions), "the client must unregister its shared memory"


def client_regions(t) -> list[str]:
    """The client's registered regions, by their segment (the HTTP door in front of this server has
    one of its own; each is registered under a name that is not its segment's)."""
    regions = t.grpc.get_system_shared_memory_status(as_json=True).get("regions", {})
    return [name for name, region in regions.items() if region.get("key", "").lstrip("/").startswith("neopp_kv_")]
