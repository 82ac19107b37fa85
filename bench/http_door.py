"""What the HTTP door costs: one 44 MB-KV request through the door, through the HTTP front it
replaced (relaying to Triton's own HTTP), and over gRPC straight to Triton, side by side.

The checkpoint has the real KV geometry (36 layers x 8 KV heads x 128 dims; tiny widths
elsewhere), so the prefix is the real 44 MB; the request uses the binary tensor extension over
HTTP and raw bf16 bytes over gRPC, both built once, so the client costs almost nothing. The door
and the old front each run in a process of their own, as the launcher runs the door; the old
front is read from the commit before the door (``--old-front-rev``). Rounds alternate the three
paths; the door's own time is its median minus gRPC's.

    python -m bench.http_door [--repeats 5] [--steps 4] [--out bench/http_door.md]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import torch
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from bench.common import REPO, stats, write_report
from bench.kv_ingest import write_geometry_checkpoint
from neopp.ports import LOOPBACK, free_ports
from neopp.serving.tritonserver import TritonServer
from testing.faults import wait_for
from testing.tiny_checkpoint import random_kv

MODEL = "neopp_dense"
ADMIN_KEY, FRONT_KEY = "bench-operator-key-0123456789", "bench-front-key-0123456789"
PATHS = ("HTTP door", "old HTTP front + Triton HTTP", "gRPC direct")


def scalars(size: int, steps: int) -> list[tuple[str, str, list[int], bytes]]:
    """(name, datatype, shape, raw bytes) of every input but the KV."""
    def i64(*values: int) -> bytes:
        return torch.tensor(values, dtype=torch.int64).numpy().tobytes()
    return [("INDEX_OFFSET_COND", "INT64", [1], i64(300)), ("SIZE", "INT64", [2], i64(size, size)),
            ("STEPS", "INT64", [1], i64(steps)), ("SEED", "INT64", [1], i64(3)),
            ("CFG_SCALE", "FP32", [1], torch.tensor([1.0]).numpy().tobytes()),
            ("OUTPUT_FORMAT", "BYTES", [1], len(b"png").to_bytes(4, "little") + b"png")]


def http_body(kv: torch.Tensor, size: int, steps: int) -> tuple[bytes, int]:
    raw = kv.contiguous().view(torch.uint8).numpy().tobytes()
    tensors = [("COND_KV", "BF16", list(kv.shape), raw), *scalars(size, steps)]
    header = {"inputs": [{"name": n, "datatype": d, "shape": s, "parameters": {"binary_data_size": len(b)}}
                         for n, d, s, b in tensors],
              "outputs": [{"name": "IMAGE", "parameters": {"binary_data": True}}]}
    text = json.dumps(header).encode()
    return text + b"".join(b for *_, b in tensors), len(text)


def grpc_request(kv: torch.Tensor, size: int, steps: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=MODEL)
    tensors = [("COND_KV", "BF16", list(kv.shape), kv.contiguous().view(torch.uint8).numpy().tobytes()),
               *scalars(size, steps)]
    for name, datatype, shape, raw in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(raw)
    request.outputs.add(name="IMAGE")
    return request


def grpc_image(stub: pb_grpc.GRPCInferenceServiceStub, request: pb.ModelInferRequest) -> bytes:
    return stub.ModelInfer(request, timeout=600).raw_output_contents[0][4:]  # after the length prefix


def http_image(port: int, body: bytes, header_length: int) -> bytes:
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=600)
    try:
        conn.request("POST", f"/v2/models/{MODEL}/infer", body=body,
                     headers={"Inference-Header-Content-Length": str(header_length)})
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, data[:300]
        length = resp.getheader("Inference-Header-Content-Length")
        result = httpclient.InferenceServerClient.parse_response_body(
            data, header_length=int(length) if length else None)
        return bytes(result.as_numpy("IMAGE")[0])
    finally:
        conn.close()


def start_fronts(tmp: Path, server: TritonServer, rev: str) -> tuple[list[subprocess.Popen], int, int]:
    """The door and the old front, each a process of its own; their ports."""
    old = tmp / "old" / "old_front"
    old.mkdir(parents=True)
    (old / "__init__.py").write_text("")
    for name in ("admin.py", "http_front.py"):
        source = subprocess.run(["git", "show", f"{rev}:backend_src/neopp/serving/{name}"], cwd=REPO,
                                capture_output=True, check=True).stdout
        (old / name).write_bytes(source)
    door_port, old_port = free_ports(2)
    wait = "import sys; sys.stdin.read()"
    door = (f"from neopp.front.server import DoorServer; DoorServer({LOOPBACK!r}, {door_port}, "
            f"{server.grpc_url!r}, ({LOOPBACK!r}, {server.http_port}), {FRONT_KEY!r}).start(); {wait}")
    front = (f"import sys; sys.path.insert(0, {str(old.parent)!r}); from old_front.http_front import HttpFront; "
             f"HttpFront({LOOPBACK!r}, {old_port}, ({LOOPBACK!r}, {server.http_port}), {FRONT_KEY!r}).start(); {wait}")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, cwd=REPO) for code in (door, front)]
    for port in (door_port, old_port):
        wait_for(lambda port=port: _listening(port), 60, poll=0.1)
    return procs, door_port, old_port


def _listening(port: int) -> bool:
    try:
        http.client.HTTPConnection(LOOPBACK, port, timeout=2).connect()
        return True
    except OSError:
        return False


def measure(calls: dict[str, Callable[[], bytes]], repeats: int) -> dict[str, list[float]]:
    """Alternating rounds; every path's image must be the same bytes."""
    images = {label: call() for label, call in calls.items()}  # warm-up, and the check
    assert len(set(images.values())) == 1, "the paths answered different images"
    times: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(repeats):
        for label, call in calls.items():
            start = time.perf_counter()
            call()
            times[label].append(time.perf_counter() - start)
    return times


def report(rows: dict[int, dict[str, list[float]]], mb: float, args: argparse.Namespace) -> str:
    lines = [f"KV: [36, 2, 300, 8, 128] bf16 = {mb:.1f} MB per request (binary tensor extension over HTTP, "
             f"raw bytes over gRPC); `{MODEL}`, {args.steps} steps, CFG off, PNG; {args.repeats} alternating rounds "
             f"after one warm-up each; old front from commit {args.old_front_rev}.", "",
             "| size | path | median ms | min | max | over gRPC (ms) | per MB (ms) |", "|---|---|---|---|---|---|---|"]
    summary = []
    for size, times in rows.items():
        grpc_ms = stats(times["gRPC direct"])[0] * 1e3
        for label in PATHS:
            med, lo, hi = (v * 1e3 for v in stats(times[label]))
            extra = "-" if label == "gRPC direct" else f"{med - grpc_ms:.1f}"
            per_mb = "-" if label == "gRPC direct" else f"{(med - grpc_ms) / mb:.2f}"
            lines.append(f"| {size}x{size} | {label} | {med:.1f} | {lo:.1f} | {hi:.1f} | {extra} | {per_mb} |")
        door, old = stats(times["HTTP door"])[0] * 1e3, stats(times["old HTTP front + Triton HTTP"])[0] * 1e3
        summary.append(f"* {size}x{size}: door / old front **{door / old:.2f}x**; the door's own time "
                       f"{door - grpc_ms:.1f} ms = **{(door - grpc_ms) / door * 100:.1f} %** of its end-to-end.")
    load = os.getloadavg()
    return "\n".join(lines + ["", *summary, "",
                              f"Load average while it ran: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
                              "(1/5/15 min); the machine is shared, so compare the rows of one run."])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--old-front-rev", default="2a20307", help="a commit that has the old HTTP front")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "http_door.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="neopp_http_door_") as tmp_name:
        tmp = Path(tmp_name)
        cfg = write_geometry_checkpoint(tmp / "ckpt")
        kv = random_kv(cfg, 300, seed=1).to(torch.bfloat16)
        env = dict(os.environ, NEOPP_CHECKPOINT=str(tmp / "ckpt"))
        server = TritonServer(REPO / "model_repository", env=env, log_path=tmp / "tritonserver.log",
                              admin_key=ADMIN_KEY, front_key=FRONT_KEY, http_address=LOOPBACK,
                              extra_args=["--model-control-mode=explicit", f"--load-model={MODEL}"])
        with server:
            procs, door_port, old_port = start_fronts(tmp, server, args.old_front_rev)
            channel = grpc.insecure_channel(server.grpc_url, options=[("grpc.max_send_message_length", 1 << 30),
                                                                      ("grpc.max_receive_message_length", 1 << 30)])
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            try:
                rows = {}
                for size in args.sizes:
                    body, length = http_body(kv, size, args.steps)
                    request = grpc_request(kv, size, args.steps)
                    calls = {"HTTP door": lambda b=body, n=length: http_image(door_port, b, n),
                             "old HTTP front + Triton HTTP": lambda b=body, n=length: http_image(old_port, b, n),
                             "gRPC direct": lambda r=request: grpc_image(stub, r)}
                    rows[size] = measure(calls, args.repeats)
            finally:
                channel.close()
                for proc in procs:
                    proc.stdin.close()
                    proc.kill()
                    proc.wait(timeout=30)
    mb = kv.numel() * kv.element_size() / 1e6
    write_report(args.out, "HTTP door: its cost next to the old front and gRPC", report(rows, mb, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
