"""Two replicas behind a real HAProxy with the cluster's routing rules (`make serve-replicas`).

Plain requests spread over the replicas; every turn of a chat reaches the replica holding it;
a replica killed under load loses only what was running on it, new requests reach the survivor
at once, and its chats go on elsewhere with the same images (the LightLLM client continues them
statelessly from their last NEXT_RNG_STATE).
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from bench.failover import ENV, MODELS, SIZE, STEPS, drill, plain_inputs, reference_chat
from deploy.replicas import ReplicaSet
from testing import REPO

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None,
                                reason="haproxy is not installed (make deps installs Debian's)")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> ReplicaSet:
    rs = ReplicaSet(tmp_path_factory.mktemp("replicas"), 2, MODELS, env=ENV).start()
    try:
        yield rs
    finally:
        rs.stop()
        assert all(r.proc.returncode is not None for r in rs.running)


def successes(rs: ReplicaSet, model: str) -> list[int]:
    counts = []
    for r in rs.running:
        client = grpcclient.InferenceServerClient(f"{r.replica.host}:{r.replica.grpc_port}")
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
        counts.append(int(stats["inference_stats"]["success"].get("count", 0)))
        client.close()
    return counts


def served_since(rs: ReplicaSet, before: list[int], expected: int, within_s: float = 30.0) -> list[int]:
    """Each replica's successes since ``before``, once they add up to ``expected`` (or the time is
    up): Triton counts a success when it releases the request, a moment after the client has
    its answer."""
    deadline = time.monotonic() + within_s
    while True:
        served = [a - b for a, b in zip(successes(rs, "neopp_dense"), before)]
        if sum(served) >= expected or time.monotonic() > deadline:
            return served
        time.sleep(0.2)


def test_plain_requests_spread_over_the_replicas(replicas: ReplicaSet):
    before = successes(replicas, "neopp_dense")
    client = grpcclient.InferenceServerClient(replicas.url("grpc"))
    images = {bytes(client.infer("neopp_dense", plain_inputs(STEPS, seed=9)).as_numpy("IMAGE")[0]) for _ in range(12)}
    client.close()
    served = served_since(replicas, before, 12)
    # round-robin gives 6 each; a replica briefly out of the pool (a health check slow on a busy
    # machine) may take fewer, but both take part
    assert sum(served) == 12 and min(served) >= 1, f"per replica: {served}"
    assert len(images) == 1, "the same seed gives the same bytes on every replica"


def test_every_turn_of_a_chat_reaches_its_replica_and_a_replica_readiness_names_its_models(replicas: ReplicaSet):
    sys.path.insert(0, str(REPO / "client_examples"))
    from lightllm_client import NeoPPTritonClient

    from neopp.model.kv_cache import load_kv_file

    kv = REPO / "demo" / "checkpoints" / "dense" / "sample_kv"
    for chat in range(4):
        client = NeoPPTritonClient(replicas.url("grpc"), sequence_id=500 + chat, shared_memory=False)
        client.set_kvcache(load_kv_file(kv / "cond_kv.pt"), load_kv_file(kv / "uncond_kv.pt"))
        client.set_inference_params(11, 1, infer_steps=STEPS, output_format="png")
        images = [base64.b64decode(client.generate(seed=40 + chat if t == 0 else None, target_shape=SIZE))
                  for t in range(3)]
        assert client.last_turn == 2 and not client.stateless, "the session served all three turns"
        client.close()
        assert images == reference_chat(replicas.url("grpc"), 40 + chat, 3)
    for r in replicas.running:  # docker/ready.py: the probe of the container and of Kubernetes
        ready = subprocess.run([sys.executable, str(REPO / "docker" / "ready.py")], capture_output=True, text=True,
                               env={**os.environ, "NEOPP_HTTP_PORT": str(r.replica.http_port),
                                    "NEOPP_MODELS": " ".join(MODELS)}, timeout=30)
        assert ready.returncode == 0, ready.stdout
        missing = subprocess.run([sys.executable, str(REPO / "docker" / "ready.py")], capture_output=True, text=True,
                                 env={**os.environ, "NEOPP_HTTP_PORT": str(r.replica.http_port),
                                      "NEOPP_MODELS": "neopp_dense neopp_moe"}, timeout=30)
        assert missing.returncode == 1 and missing.stdout.startswith("neopp_moe: not ready")


def test_a_turn_with_the_token_of_a_session_this_replica_lacks_says_how_to_go_on(replicas: ReplicaSet):
    r = replicas.running[0].replica
    client = grpcclient.InferenceServerClient(f"{r.host}:{r.grpc_port}")
    token = grpcclient.InferInput("SESSION_TOKEN", [1], "BYTES")
    token.set_data_from_numpy(np.array([b"0" * 32], dtype=np.object_))
    inputs = plain_inputs(STEPS) + [token]
    with pytest.raises(InferenceServerException) as err:
        client.infer("neopp_session", inputs, sequence_id=4242, sequence_start=True)
    client.close()
    assert "StatusCode.NOT_FOUND" in str(err.value.status())
    assert "does not hold" in err.value.message() and "NEXT_RNG_STATE as RNG_STATE" in err.value.message()
    # the slot Triton gave that start is freed at once, not held for the sequence idle bound
    freed = "session 4242 released its Triton slot"
    deadline = time.monotonic() + 30
    while freed not in replicas.running[0].log.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the refused start's slot was not released"
        time.sleep(0.1)


def test_a_crash_under_load_loses_only_what_ran_on_it_and_its_chats_go_on(replicas: ReplicaSet):
    """Last in this module: it kills one replica."""
    result = drill(replicas, chats=6, clients=3, before_s=2.0, after_s=4.0)
    print(f"\nrequests {len(result.outcomes)}, failed in flight {len(result.in_flight_failed)}, failed after "
          f"{len(result.lost_after)}; router took it out after {result.down_after_s:.2f}s; first answer after "
          f"{result.first_success_s:.2f}s; chats moved {result.chats_moved}, exact {result.chats_exact} of 6")
    assert not result.lost_after, [o.error for o in result.lost_after]
    assert all("UNAVAILABLE" in o.error for o in result.in_flight_failed), [o.error for o in result.in_flight_failed]
    assert result.down_after_s is not None and result.down_after_s < 5.0
    assert result.first_success_s < 5.0
    assert result.chats_exact == 6, result.detail
    assert len(result.outcomes) > 10
