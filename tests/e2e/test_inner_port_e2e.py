"""Triton's inner port stays private, against a launcher it started (``python -m neopp.launcher
serve`` with an operator key and an API key):

* no key is on the command line of the launcher, the door's parse workers or the Python stubs;
  tritonserver's holds the operator and API keys in its restriction flags and nothing else secret
  (Triton 2.51 reads them nowhere else: docs/security.md says what that leaves); neither key is
  in the environment of tritonserver or its stubs;
* Triton's own HTTP and gRPC are Unix sockets in a 0700 directory: tritonserver listens on TCP
  only for metrics; the public gRPC port is the launcher's gRPC front, which takes no message
  over the door's body bound (RESOURCE_EXHAUSTED, Triton never sees it), answers every call it
  cannot relay (no message, bytes that do not parse, too many fields) with INVALID_ARGUMENT,
  answers gRPC's health protocol, and holds back a stream client that reads nothing;
* a ``STEPS`` of shape [1000000000000], which aborts Triton's own HTTP parser, is a 400 naming
  STEPS at the door (JSON and binary), an INVALID_ARG over gRPC, and the server stays up.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from neopp.launcher.admin import GRPC_API_KEY_HEADER
from neopp.launcher.inner_http import grpc_beside, socket_path
from neopp.launcher.key_shim import compiler
from neopp.launcher.tritonserver import grpc_socket_target
from neopp.procs import cmdline, descendants, process_group_members
from testing.attacks import GrpcAbuse
from testing.door_attacks import post, request
from testing.faults import wait_for
from testing.launched import serving

MODEL = "neopp_dense"
KEY = "inner-operator-key-0123456789abcdef"
API = "inner-api-key-0123456789abcdef"
GRPC_API = {GRPC_API_KEY_HEADER: f"Bearer {API}"}
HUGE = 1_000_000_000_000
MAX_BODY_MIB = 4
CLIENT_CALLS = 16  # gRPC calls (and HTTP connections) one address may hold open
RESTRICTION_FLAGS = ("--http-restricted-api=", "--grpc-restricted-protocol=")


@pytest.fixture(scope="module")
def launched(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("inner") / "serve.log"
    with serving(log, {"NEOPP_CHECKPOINT": str(tiny_dense), "NEOPP_ADMIN_KEY": KEY, "NEOPP_API_KEY": API},
                 (MODEL,), launcher_args=("--max-body-mib", str(MAX_BODY_MIB), "--max-connections", "64",
                                          "--max-client-connections", str(CLIENT_CALLS))) as handle:
        yield handle
    for _, address, _ in handle.servers():
        assert not socket_path(address).parent.exists(), "the private directory was left behind"


def _listening_tcp_ports(pid: int) -> set[int]:
    """TCP ports ``pid`` listens on: its socket descriptors matched in /proc/net/tcp{,6}."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_no_key_on_a_command_line(launched):
    server = launched.server_pid
    door_side = [launched.proc.pid, *descendants(launched.proc.pid)]  # the launcher, its parse workers
    stubs = [pid for pid in process_group_members(server) if pid != server]
    assert stubs, "no Python stub found"
    for pid in [p for p in door_side if p not in (server, *stubs)] + stubs:
        line = " ".join(cmdline(pid))
        assert KEY not in line and API not in line, f"a key on the command line of {pid}: {line[:200]}"
    args = cmdline(server)
    holding = [a for a in args if KEY in a or API in a]
    if compiler() is not None:  # markers on the command line, the keys through a pipe (key_shim)
        assert not holding, holding
        assert sum("@NEOPP_KEY_" in a for a in args if a.startswith(RESTRICTION_FLAGS)) == 3, args
    else:  # what remains without a compiler: the keys in the restriction flags alone
        assert holding and all(a.startswith(RESTRICTION_FLAGS) for a in holding), holding
    assert not any("front-key" in a for a in args), "a front key is no longer needed"
    for pid in [server, *stubs]:  # nor in the environment its models see
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert KEY.encode() not in environ and API.encode() not in environ, f"a key in the environment of {pid}"


def test_triton_http_is_a_private_socket(launched):
    pid, address, _ = launched.servers()[-1]
    path = socket_path(address)
    assert path is not None and f"--http-address={address}" in cmdline(pid)
    directory = path.parent.stat()
    assert stat.S_IMODE(directory.st_mode) == 0o700 and directory.st_uid == os.getuid()
    assert stat.S_ISSOCK(path.stat().st_mode)
    grpc_address = grpc_beside(address)
    assert f"--grpc-address={grpc_address}" in cmdline(pid)
    assert stat.S_ISSOCK(socket_path(grpc_socket_target(grpc_address)).stat().st_mode)
    assert _listening_tcp_ports(pid) == {launched.metrics_port}
    assert launched.grpc_port in _listening_tcp_ports(launched.proc.pid), "the gRPC front is the launcher's"
    status, _, answer = request(launched.http_port, b"GET /neopp/addresses HTTP/1.1\r\nHost: localhost\r\n"
                                                    b"Connection: close\r\n\r\n")
    assert status == 200 and json.loads(answer)["grpc"] == f"localhost:{launched.grpc_port}", answer


def test_the_grpc_front_bounds_a_message_before_triton(launched, kv):
    """A message over the bound is refused by the front; the server's memory and its readiness stay."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{launched.grpc_port}")
    try:
        big = np.zeros((MAX_BODY_MIB + 1) << 20, np.uint8)
        tensor = grpcclient.InferInput("COND_KV", [big.size], "UINT8").set_data_from_numpy(big)
        with pytest.raises(InferenceServerException) as refused:
            client.infer(MODEL, [tensor], headers=GRPC_API)
        assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED", refused.value.message()
        assert _generate(client, kv)
    finally:
        client.close()


def _steps(shape: list[int], raw: bytes) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("STEPS", shape, "INT64")
    tensor._raw_content = raw  # the declared shape as an attacker sends it, not what numpy would build
    return [tensor]


def _generate(client: grpcclient.InferenceServerClient, kv: tuple[np.ndarray, np.ndarray]) -> bytes:
    arrays = {"COND_KV": (kv[0], "BF16"), "INDEX_OFFSET_COND": (np.array([24], np.int64), "INT64"),
              "SIZE": (np.array([32, 32], np.int64), "INT64"), "STEPS": (np.array([2], np.int64), "INT64"),
              "SEED": (np.array([5], np.int64), "INT64"), "CFG_SCALE": (np.array([1.0], np.float32), "FP32")}
    tensors = []
    for name, (array, dtype) in arrays.items():
        tensors.append(grpcclient.InferInput(name, list(array.shape), dtype).set_data_from_numpy(array))
    return bytes(client.infer(MODEL, tensors, headers=GRPC_API).as_numpy("IMAGE")[0])


def test_giant_steps_shape_is_refused_and_the_server_stays(launched, kv):
    pid = launched.server_pid
    auth = f"Authorization: Bearer {API}\r\n"
    body = json.dumps({"inputs": [{"name": "STEPS", "datatype": "INT64", "shape": [HUGE], "data": [1]}]}).encode()
    status, _, answer = post(launched.http_port, f"/v2/models/{MODEL}/infer", body, extra=auth)
    assert status == 400 and "STEPS" in json.loads(answer)["error"], answer
    header = json.dumps({"inputs": [{"name": "STEPS", "datatype": "INT64", "shape": [HUGE],
                                     "parameters": {"binary_data_size": 8}}]}).encode()
    status, _, answer = post(launched.http_port, f"/v2/models/{MODEL}/infer", header + bytes(8),
                             extra=f"{auth}Inference-Header-Content-Length: {len(header)}\r\n")
    assert status == 400 and "STEPS" in json.loads(answer)["error"], answer

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{launched.grpc_port}")
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.infer(MODEL, _steps([HUGE], np.array([1], np.int64).tobytes()), headers=GRPC_API)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT" and "STEPS" in refused.value.message()
        time.sleep(1.0)
        assert launched.server_pid == pid and process_group_members(pid), "the server died"
        assert request(launched.http_port, b"GET /v2/health/ready HTTP/1.1\r\nHost: localhost\r\n\r\n")[0] == 200
        assert client.is_server_ready() and client.is_model_ready(MODEL)
        assert _generate(client, kv)
    finally:
        client.close()


SERVICE_PATH = "/inference.GRPCInferenceService/"
KEYED = tuple(GRPC_API.items())


def _ended(channel: grpc.Channel, method: str, messages: list[bytes]) -> tuple[grpc.StatusCode, str]:
    """How a call of raw ``messages`` ends (a deadline, so a call left unanswered fails the test)."""
    call = channel.stream_stream(SERVICE_PATH + method, request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as ended:
        list(call(iter(messages), metadata=KEYED, timeout=60))
    return ended.value.code(), ended.value.details()


def test_the_grpc_front_answers_every_call_it_cannot_relay(launched, kv):
    many = pb.ModelInferRequest(model_name=MODEL)
    for _ in range(70_000):  # 140 kB on the wire, 70,000 messages once parsed (the bound: 8,192)
        many.outputs.add()
    with grpc.insecure_channel(f"127.0.0.1:{launched.grpc_port}") as channel:
        # a unary call of no message: grpcio's own unary handling left it unanswered
        code, details = _ended(channel, "ModelInfer", [])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "sent no ModelInferRequest" in details
        code, details = _ended(channel, "ModelInfer", [b"\xff\xff\xff"])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a ModelInferRequest" in details, details
        code, details = _ended(channel, "ModelInfer", [many.SerializeToString()])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 8192 fields" in details, details
        hidden = bytes([0x9B, 0x06, 0x9C, 0x06]) + many.SerializeToString()  # a group first: still counted
        code, details = _ended(channel, "ModelInfer", [hidden])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a ModelInferRequest" in details, details
        echoed = pb.ModelInferRequest(model_name=MODEL, id="x" * 5000)  # every answer would echo it
        code, details = _ended(channel, "ModelInfer", [echoed.SerializeToString()])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details == "id: at most 4096 bytes, got 5000", details
        code, details = _ended(channel, "ModelStreamInfer", [b"\xff"])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "a request of this stream" in details, details
        code, details = _ended(channel, "ServerLive", [b"\x0a\x80"])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a ServerLiveRequest" in details, details
        check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                                    response_deserializer=None)
        assert check(b"", timeout=30) == b"\x08\x01"  # SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            check(b"\x0a\x05other", timeout=30)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{launched.grpc_port}")
    try:
        assert _generate(client, kv)
    finally:
        client.close()


def _bytes_held(port: int) -> int:
    _, _, text = request(port, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    held = [line for line in text.decode().splitlines() if line.startswith("neopp_http_body_bytes_held ")]
    return int(float(held[0].split()[1]))


def test_a_stream_client_that_reads_nothing_is_held_back(launched, kv):
    """Its answers stop being read from Triton, then its requests from it: before, the front read
    them all and queued every answer, so the launcher's memory grew with what the client sent."""
    sent, total = [0], 64_000
    ident = "x" * 4000  # each answer echoes it (the bound is 4096 bytes): 64,000 of them would be 256 MB

    def requests():
        for _ in range(total):
            sent[0] += 1
            yield pb.ModelInferRequest(model_name="no_such_model", id=ident).SerializeToString()

    with grpc.insecure_channel(f"127.0.0.1:{launched.grpc_port}") as channel:
        call = channel.stream_stream(SERVICE_PATH + "ModelStreamInfer", request_serializer=None,
                                     response_deserializer=None)(requests(), metadata=KEYED)
        last, unchanged = -1, 0
        for _ in range(360):  # until the client has been unable to send for 5 s (at most 3 minutes)
            time.sleep(0.5)
            unchanged, last = (unchanged + 1 if sent[0] == last else 0), sent[0]
            if unchanged >= 10 or last >= total:
                break
        assert sent[0] < total // 2, f"the front read {sent[0]} requests of a client that reads nothing"
        # what Triton holds of it stays counted until answered: the client's share, 32 requests
        assert 0 < _bytes_held(launched.http_port) <= 32 * 4100
        # the rest of what it could send went into its own buffers: HTTP/2 lets a client take some
        # megabytes of answers it has not read (more on a busy machine, where windows grow)
        call.cancel()
    for _ in range(120):  # the stream's requests held by the front are given back
        if _bytes_held(launched.http_port) == 0:
            break
        time.sleep(0.25)
    assert _bytes_held(launched.http_port) == 0
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{launched.grpc_port}")
    try:  # the stream's count of this client was given back: its generations are served
        assert _generate(client, kv) and _generate(client, kv)
    finally:
        client.close()


def test_the_soaks_grpc_attack_is_refused_in_every_form(launched, kv):
    """The soak's gRPC attack (testing.attacks.GrpcAbuse), a small dose: each kind of call is
    answered INVALID_ARGUMENT and no stream is left with what it held."""
    attack = GrpcAbuse(f"127.0.0.1:{launched.grpc_port}", hold_s=2.0, metadata=KEYED).start()
    kinds = ("no message", "garbage", "70,000 fields")
    done = wait_for(lambda: attack.counts["unread streams"] >= 1
                    and all(attack.counts[f"{kind}: INVALID_ARGUMENT"] >= 1 for kind in kinds), timeout=120)
    counts = attack.stop()
    assert done, counts
    assert set(counts) == {*(f"{kind}: INVALID_ARGUMENT" for kind in kinds), "unread streams",
                           "unread stream requests sent"}, counts
    assert counts["unread stream requests sent"] < 32_000 * counts["unread streams"], counts
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{launched.grpc_port}")
    try:
        assert _generate(client, kv)
    finally:
        client.close()


def test_an_outputs_classification_never_reaches_triton(launched, kv):
    """Triton 2.51 dies with SIGFPE classifying a BYTES output (every output of ours is one):
    both ports refuse it, and the server stays."""
    pid = launched.server_pid
    body = json.dumps({"inputs": [{"name": "STEPS", "datatype": "INT64", "shape": [1], "data": [2]}],
                       "outputs": [{"name": "IMAGE", "parameters": {"classification": 1}}]}).encode()
    status, _, answer = post(launched.http_port, f"/v2/models/{MODEL}/infer", body,
                             extra=f"Authorization: Bearer {API}\r\n")
    assert status == 400 and "classification is not served" in json.loads(answer)["error"], answer
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{launched.grpc_port}")
    try:
        request = pb.ModelInferRequest(model_name=MODEL)
        request.outputs.add(name="IMAGE").parameters["classification"].int64_param = 1
        with grpc.insecure_channel(f"127.0.0.1:{launched.grpc_port}") as channel:
            code, details = _ended(channel, "ModelInfer", [request.SerializeToString()])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "classification is not served" in details, details
        assert launched.server_pid == pid and process_group_members(pid), "the server died"
        assert _generate(client, kv)
    finally:
        client.close()


def test_idle_grpc_calls_give_way_and_health_is_always_answered(launched, kv):
    """A client holding calls that send nothing: at its cap the one idle longest is given up for
    a new call, and gRPC's health check counts in no cap. Compressed messages are refused whole."""
    release = threading.Event()

    def nothing():
        release.wait(120)
        return
        yield

    with grpc.insecure_channel(f"127.0.0.1:{launched.grpc_port}") as channel:
        idle = channel.stream_stream(SERVICE_PATH + "ModelInfer", request_serializer=None, response_deserializer=None)
        held = [idle(nothing(), metadata=KEYED) for _ in range(CLIENT_CALLS)]
        check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                                    response_deserializer=None)
        assert check(b"", timeout=30) == b"\x08\x01"
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{launched.grpc_port}")
        try:
            assert _generate(client, kv)  # its call replaced the oldest idle one
        finally:
            client.close()
        assert wait_for(lambda: any(call.done() for call in held), timeout=60)
        ended = [call for call in held if call.done()]  # the one the server saw first: not always held[0]
        assert len(ended) == 1 and ended[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ended
        assert ended[0].details().startswith("given up for a newer call"), ended[0].details()
        zipped = channel.unary_unary(SERVICE_PATH + "ServerLive", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as refused:
            zipped(b"", timeout=30, compression=grpc.Compression.Gzip)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED, refused.value
        release.set()
        for call in held:
            call.cancel()


def test_refused_large_requests_leave_the_launcher_as_it_was(launched):
    """Each relayed request is held several times over (received, parsed, sent on); a refused one
    was kept alive by its aborted call's traceback, and the allocator kept what was freed."""
    from neopp.procs import rss_bytes

    big = pb.ModelInferRequest(model_name="no_such_model", raw_input_contents=[b"\0" * (3 << 20)]).SerializeToString()
    with grpc.insecure_channel(f"127.0.0.1:{launched.grpc_port}") as channel:
        for _ in range(3):  # the front's own first allocations
            assert _ended(channel, "ModelInfer", [big])[0] == grpc.StatusCode.NOT_FOUND
        before = rss_bytes([launched.proc.pid])
        for _ in range(40):  # 40 x 3 MiB, each received, parsed and sent on: ~360 MiB if kept
            assert _ended(channel, "ModelInfer", [big])[0] == grpc.StatusCode.NOT_FOUND
        grown = rss_bytes([launched.proc.pid]) - before
    assert grown < 96 << 20, f"the launcher kept {grown >> 20} MiB of 40 refused requests"
