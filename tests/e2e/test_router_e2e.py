"""The router's gRPC message limit, with the real HAProxy (deploy.router's rules) in front of the suite's
server: a request within the limit gets the server's own answer; a larger message, or a unary call
whose first message prefix does not arrive in time, is refused by the router and never reaches the
server. The limit is lowered here (the cluster's is 256 MiB, checked in tests/test_k8s_manifests.py)."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from deploy.router import UNARY_INFER, Replica, render_local
from neopp.ports import LOOPBACK, free_ports

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None,
                                reason="haproxy is not installed (make deps installs Debian's)")

LIMIT = 1 << 20  # bytes of one gRPC message
PREFIX_WAIT_S = 1.0
COUNTS = ("nv_inference_request_success", "nv_inference_request_failure")


@pytest.fixture(scope="module")
def router(triton, tmp_path_factory):
    """HAProxy on free loopback ports, its one replica the suite's server (gRPC) and its door (HTTP)."""
    grpc_port, http_port = free_ports(2)
    replica = Replica(LOOPBACK, triton.server.grpc_port, triton.door.server_address[1])
    config = tmp_path_factory.mktemp("router") / "haproxy.cfg"
    config.write_text(render_local([replica], LOOPBACK, grpc_port, http_port, max_grpc_message=LIMIT,
                                   prefix_wait_s=PREFIX_WAIT_S))
    proc = subprocess.Popen([shutil.which("haproxy"), "-db", "-f", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:  # the replica is in the pool once its health check passed
            try:
                with urllib.request.urlopen(f"http://{LOOPBACK}:{http_port}/v2/health/ready", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "haproxy did not start"
                time.sleep(0.2)
        client = grpcclient.InferenceServerClient(f"{LOOPBACK}:{grpc_port}")
        yield client, f"{LOOPBACK}:{grpc_port}"
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def served(triton) -> float:
    return sum(triton.metric(name) for name in COUNTS)


def test_a_request_within_the_limit_gets_the_servers_answer(triton, router):
    client, _ = router
    via_router = client.infer("neopp_dense", triton.grpc_tensors(SEED=np.array([5], np.int64)), client_timeout=120)
    direct = triton.infer_grpc(SEED=np.array([5], np.int64))
    assert bytes(via_router.as_numpy("IMAGE")[0]) == bytes(direct.as_numpy("IMAGE")[0])


def test_a_larger_message_is_refused_by_the_router(triton, router):
    client, _ = router
    layers, _, _, heads, dim = triton.cond.shape
    tokens = LIMIT // (layers * 2 * heads * dim * 2) + 64  # BF16: just past the limit
    big = np.zeros((layers, 2, tokens, heads, dim), np.float32)
    before = served(triton)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("neopp_dense", triton.grpc_tensors(COND_KV=(big, "BF16")), client_timeout=60)
    assert "413" in str(refused.value), refused.value
    assert served(triton) == before  # the server never saw it
    assert client.infer("neopp_dense", triton.grpc_tensors(), client_timeout=120).as_numpy("IMAGE")[0]


def test_a_unary_call_whose_prefix_trickles_is_refused(triton, router):
    _, address = router
    request = service_pb2.ModelInferRequest(model_name="neopp_dense").SerializeToString()

    def trickle():
        time.sleep(PREFIX_WAIT_S + 2)  # the request's headers went out; its message does not follow in time
        yield request

    with grpc.insecure_channel(address) as channel:
        call = channel.stream_unary(UNARY_INFER, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as refused:
            call(trickle(), timeout=30)
    assert "408" in str(refused.value.details()), refused.value
