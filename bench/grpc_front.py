"""What the launcher's gRPC front costs: the same gRPC request sent straight to Triton's gRPC port
and through the front (neopp.launcher.door.grpc_front) relaying to it, side by side.

The checkpoint has the real KV geometry (36 layers x 8 KV heads x 128 dims; tiny widths
elsewhere), so a 300-token prefix is the real 44 MB: the worst case for a relay, which parses
every message and serialises it again. A 16-token prefix (2.4 MB) shows a small request. The
front runs in a process of its own, as in the launcher beside the door; here it relays to
Triton's TCP gRPC port, as the direct path uses (the launcher's Unix socket is not slower).
Rounds alternate the paths; every answer must be the same image.

    python -m bench.grpc_front [--repeats 5] [--steps 4] [--out bench/grpc_front.md]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import grpc
import torch
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from bench.common import REPO, load_note, stats, write_report
from bench.http_door import MODEL, grpc_image, grpc_request, measure
from bench.kv_ingest import write_geometry_checkpoint
from neopp.launcher.tritonserver import TritonServer
from neopp.ports import LOOPBACK, free_ports
from testing.faults import wait_for
from testing.tiny_checkpoint import random_kv

DIRECT, FRONT = "gRPC direct to Triton", "gRPC through the front"
OPTIONS = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]


def start_front(target: str, port: int) -> subprocess.Popen:
    code = ("import sys; from neopp.launcher.door.grpc_front import GrpcFront; "
            f"front = GrpcFront({f'{LOOPBACK}:{port}'!r}, {target!r}, 1 << 30).start(); "
            "sys.stdin.read(); front.stop()")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, cwd=REPO)


def _serving(address: str) -> bool:
    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=2)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


def report(rows: dict[tuple[int, int], dict[str, list[float]]], args: argparse.Namespace) -> str:
    lines = [f"`{MODEL}`, {args.steps} steps, CFG off, PNG, raw bf16 KV bytes in the gRPC message; "
             f"{args.repeats} alternating rounds after one warm-up each.", "",
             "| KV tokens (MB) | size | path | median ms | min | max |", "|---|---|---|---|---|---|"]
    summary = []
    for (tokens, size), times in rows.items():
        mb = 36 * 2 * tokens * 8 * 128 * 2 / 1e6
        for label in (DIRECT, FRONT):
            med, lo, hi = (v * 1e3 for v in stats(times[label]))
            lines.append(f"| {tokens} ({mb:.1f}) | {size}x{size} | {label} | {med:.1f} | {lo:.1f} | {hi:.1f} |")
        direct, front = (stats(times[label])[0] * 1e3 for label in (DIRECT, FRONT))
        summary.append(f"* {tokens} tokens, {size}x{size}: front / direct **{front / direct:.3f}x**; the front's own "
                       f"time {front - direct:.1f} ms = {(front - direct) / front * 100:.1f} % of the request.")
    return "\n".join(lines + ["", *summary, "", load_note()])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "grpc_front.md")
    args = parser.parse_args(argv)
    cases = ((16, 256), (300, 256), (300, 1024))
    with tempfile.TemporaryDirectory(prefix="neopp_grpc_front_") as tmp_name:
        tmp = Path(tmp_name)
        cfg = write_geometry_checkpoint(tmp / "ckpt")
        env = dict(os.environ, NEOPP_CHECKPOINT=str(tmp / "ckpt"))
        server = TritonServer(REPO / "model_repository", env=env, log_path=tmp / "tritonserver.log",
                              extra_args=["--model-control-mode=explicit", f"--load-model={MODEL}"])
        with server:
            port = free_ports(1)[0]
            front = start_front(server.grpc_url, port)
            channels = {label: grpc.insecure_channel(address, options=OPTIONS)
                        for label, address in ((DIRECT, server.grpc_url), (FRONT, f"{LOOPBACK}:{port}"))}
            try:
                wait_for(lambda: _serving(f"{LOOPBACK}:{port}"), 60, poll=0.2)
                stubs = {label: pb_grpc.GRPCInferenceServiceStub(channel) for label, channel in channels.items()}
                rows = {}
                for tokens, size in cases:
                    request = grpc_request(random_kv(cfg, tokens, seed=1).to(torch.bfloat16), size, args.steps)
                    rows[(tokens, size)] = measure({label: lambda s=stub, r=request: grpc_image(s, r)
                                                    for label, stub in stubs.items()}, args.repeats)
            finally:
                for channel in channels.values():
                    channel.close()
                front.stdin.close()
                try:
                    front.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    front.kill()
                    front.wait(timeout=10)
    write_report(args.out, "gRPC front: its cost next to gRPC straight to Triton", report(rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
