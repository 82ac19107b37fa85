"""Continuous batching on a real server: one batching streaming instance vs one and two plain instances.

    python -m bench.streaming_serving [--out bench] [--checkpoint build/tiny/dense] [--quick]

One tritonserver (free loopback ports) serves, from a temporary copy of ``model_repository/``:
``neopp_dense_stream`` (1 instance, the step-batching engine), ``neopp_dense`` (1 instance, one
request at a time) and ``neopp_dense_x2`` (the same plain model with ``instance_group count: 2``;
its torch threads are split so the two instances together use the machine's cores, as
bench/serving_bench found two full-width instances oversubscribe them). For every size and
concurrency, perf_analyzer measures the three configurations one after the other (their order
rotating from point to point) so the shared machine's load hits them alike: ``--streaming`` for
the decoupled model, plain gRPC for the others, the same input data
(``client_examples/make_perf_data.py``). Then the time to the first preview (``PREVIEW_EVERY`` 1)
of the streaming model at each concurrency, through tritonclient's gRPC stream (perf_analyzer
cannot see which response carries a preview), and the resident memory of each model's stub
processes, found as children of the server started here.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from bench.common import REPO, write_report
from bench.perf_analyzer import model_kv_shape, perf_input_data, run_perf_analyzer
from bench.streaming_report import (
    CONFIGS,
    PLAIN,
    PLAIN_X2,
    STREAM,
    PerfPoint,
    parse_perf_csv,
    plot_throughput,
    report_body,
)
from neopp.launcher.model_states import KEEP_GOING_ARGS
from neopp.launcher.tritonserver import TritonServer
from neopp.procs import model_stubs, rss_parts
from testing.loadgen import grpc_inputs

COND_TOKENS, UNCOND_TOKENS = 256, 16  # as `make bench-serve`: a guided request
FULL = {"sizes": (256, 512), "concurrency": (1, 2, 4, 8)}
QUICK = {"sizes": (256,), "concurrency": (1, 4)}


def build_repository(dest: Path, x2_threads: int, layout: str = "") -> Path:
    """The three models in a fresh repository; the committed folders are copied, never edited.
    With ``layout`` the two plain instances are derived from that layout's file (on its GPUs)."""
    for name in (STREAM, PLAIN):
        shutil.copytree(REPO / "model_repository" / name, dest / name)
    shutil.copytree(REPO / "model_repository" / PLAIN, dest / PLAIN_X2)
    config = dest / PLAIN_X2 / (f"configs/{layout}.pbtxt" if layout else "config.pbtxt")
    text, named = re.subn(rf'^name: "{PLAIN}"$', f'name: "{PLAIN_X2}"', config.read_text(), flags=re.MULTILINE)
    text, counted = re.subn(r"(instance_group \[ \{ kind: KIND_[CG]PU) count: \d+", r"\1 count: 2", text)
    text, threaded = re.subn(r'(key: "num_threads" value: \{ string_value: )"\d+"', rf'\1"{x2_threads}"', text)
    if (named, counted, threaded) != (1, 1, 1):
        raise RuntimeError(f"{PLAIN} {config.name} changed shape: cannot derive {PLAIN_X2} from it")
    config.write_text(text)
    if layout:  # Triton also reads the default file's name; keep it consistent
        default = dest / PLAIN_X2 / "config.pbtxt"
        renamed = re.sub(rf'^name: "{PLAIN}"$', f'name: "{PLAIN_X2}"', default.read_text(), flags=re.MULTILINE)
        default.write_text(renamed)
    return dest


def ensure_loaded(url: str, attempts: int = 3, models: Sequence[str] | None = None) -> None:
    """Every model (default: the three configurations') ready; a load the busy machine failed (a stub
    judged unhealthy) is tried again."""
    client = grpcclient.InferenceServerClient(url)
    try:
        for model in models or [m for _label, m in CONFIGS]:
            for _ in range(attempts):
                if client.is_model_ready(model):
                    break
                try:
                    client.load_model(model)
                except InferenceServerException as exc:
                    print(f"loading {model} again: {exc.message()}", flush=True)
            else:
                raise RuntimeError(f"{model} did not load in {attempts} attempts")
    finally:
        client.close()


def perf_point(url: str, model: str, data: Path, concurrency: int, requests: int, csv_path: Path,
               streaming: bool, timeout: float = 600.0) -> PerfPoint:
    """Exactly ``requests`` requests at ``concurrency`` (a generation outlasts any short time window)."""
    args = ["-m", model, "-i", "grpc", "-u", url, "--input-data", str(data), "--concurrency-range",
            str(concurrency), "--request-count", str(requests), "-f", str(csv_path),
            *(["--streaming"] if streaming else [])]
    code = run_perf_analyzer(args, timeout=timeout)
    if code != 0 or not csv_path.exists():
        raise RuntimeError(f"perf_analyzer exited {code} for {model} at concurrency {concurrency}")
    return parse_perf_csv(csv_path.read_text())


def requests_for(concurrency: int, per_slot: int) -> int:
    """Requests per point: ``per_slot`` for each concurrent slot, at least 8 in all."""
    return max(8, per_slot * concurrency)


def measure_throughput(url: str, work: Path, kv_dims: tuple[int, int, int], sizes: Sequence[int],
                       concurrencies: Sequence[int], steps: int, per_slot: int, timeout: float = 600.0) -> dict:
    """{(config label, size, concurrency): PerfPoint}, configurations rotating at every point."""
    rows: dict[tuple[str, int, int], PerfPoint] = {}
    turn = 0
    for size in sizes:
        data = work / f"perf_data_{size}.json"
        data.write_text(json.dumps(perf_input_data(kv_dims, COND_TOKENS, UNCOND_TOKENS, (size, size), steps,
                                                   offsets=(COND_TOKENS, UNCOND_TOKENS))))
        for model in (STREAM, PLAIN, PLAIN_X2):  # every instance has run this size once
            perf_point(url, model, data, 2, 2, work / "warmup.csv", model == STREAM, timeout)
        for c in concurrencies:
            order = CONFIGS[turn % 3:] + CONFIGS[:turn % 3]
            turn += 1
            for label, model in order:
                rows[(label, size, c)] = perf_point(url, model, data, c, requests_for(c, per_slot),
                                                    work / f"perf_{model}_{size}_{c}.csv", model == STREAM, timeout)
                print(f"  {size}x{size} concurrency {c} {label}: {rows[(label, size, c)]}", flush=True)
    return rows


def stream_inputs(kv_dims: tuple[int, int, int], size: int, steps: int, seed: int) -> list[grpcclient.InferInput]:
    layers, kv_heads, head_dim = kv_dims
    gen = torch.Generator().manual_seed(seed)

    def kv(tokens: int) -> np.ndarray:
        return torch.randn(layers, 2, tokens, kv_heads, head_dim, generator=gen).numpy()

    values = {"COND_KV": (kv(COND_TOKENS), "BF16"), "UNCOND_KV": (kv(UNCOND_TOKENS), "BF16"),
              "INDEX_OFFSET_COND": (np.array([COND_TOKENS], np.int64), "INT64"),
              "INDEX_OFFSET_UNCOND": (np.array([UNCOND_TOKENS], np.int64), "INT64"),
              "SIZE": (np.array([size, size], np.int64), "INT64"), "STEPS": (np.array([steps], np.int64), "INT64"),
              "SEED": (np.array([seed], np.int64), "INT64"), "OUTPUT_FORMAT": (np.array([b"png"], object), "BYTES"),
              "PREVIEW_EVERY": (np.array([1], np.int64), "INT64")}
    return grpc_inputs(values)


def first_previews(url: str, kv_dims: tuple[int, int, int], size: int, steps: int, concurrency: int,
                   timeout: float = 300.0) -> list[tuple[float, float]]:
    """(seconds to the first PREVIEW, seconds to the image) of ``concurrency`` streams started together,
    one gRPC stream each, as concurrent clients would."""
    clients, answers = [], []
    inputs = [stream_inputs(kv_dims, size, steps, seed=100 + i) for i in range(concurrency)]
    try:
        for _ in range(concurrency):
            answers.append(queue.Queue())
            clients.append(grpcclient.InferenceServerClient(url))
            clients[-1].start_stream(callback=lambda result, error, q=answers[-1]: q.put((time.perf_counter(),
                                                                                         result, error)))
        starts = []
        for client, request in zip(clients, inputs):
            starts.append(time.perf_counter())
            client.async_stream_infer(STREAM, request)
        return [_stream_times(q, start, timeout) for q, start in zip(answers, starts)]
    finally:
        for client in clients:
            client.stop_stream()
            client.close()


def _stream_times(answers: queue.Queue, start: float, timeout: float) -> tuple[float, float]:
    first = None
    deadline = start + timeout
    while True:
        at, result, error = answers.get(timeout=max(0.1, deadline - time.perf_counter()))
        if error is not None:
            raise RuntimeError(f"stream request failed: {error}")
        if first is None and result.as_numpy("PREVIEW") is not None:
            first = at - start
        if result.as_numpy("IMAGE") is not None:
            return (at - start if first is None else first), at - start


def measure_previews(url: str, kv_dims: tuple[int, int, int], sizes: Sequence[int], concurrencies: Sequence[int],
                     steps: int, rounds: int) -> dict:
    """{(size, concurrency): [(first preview s, image s)]} over ``rounds`` rounds."""
    out: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for size in sizes:
            for c in concurrencies:
                out.setdefault((size, c), []).extend(first_previews(url, kv_dims, size, steps, c))
    return out


def stub_memory(server: TritonServer) -> dict[str, dict[str, int]]:
    """Per model: its stubs (children of this server) and their RSS split anon / file / shmem."""
    out = {}
    for _label, model in CONFIGS:
        pids = model_stubs(server.process.pid, model)
        out[model] = {"stubs": len(pids), **rss_parts(pids)}
    return out


def checkpoint_bytes(checkpoint: Path) -> int:
    return sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench")
    parser.add_argument("--checkpoint", type=Path, default=REPO / "build" / "tiny" / "dense")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--per-slot", type=int, default=6, help="perf_analyzer requests per concurrent slot")
    parser.add_argument("--preview-rounds", type=int, default=2)
    parser.add_argument("--x2-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="torch threads of each of the two plain instances (default: half the cores)")
    parser.add_argument("--quick", action="store_true", help="256x256 at concurrency 1 and 4 only")
    args = parser.parse_args(argv)
    if not (args.checkpoint / "config.json").is_file():
        parser.error(f"--checkpoint {args.checkpoint}: no config.json there (make tiny writes build/tiny/dense)")
    matrix = QUICK if args.quick else FULL
    started, load_before = time.monotonic(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="neopp_stream_bench_") as tmp:
        work = Path(tmp)
        repo = build_repository(work / "repo", args.x2_threads)
        env = dict(os.environ, NEOPP_CHECKPOINT=str(args.checkpoint.resolve()), NEOPP_BASE_DIR=str(REPO))
        server = TritonServer(repo, env=env, log_path=work / "tritonserver.log",
                              extra_args=["--model-control-mode=explicit", *KEEP_GOING_ARGS,
                                          *(f"--load-model={m}" for _label, m in CONFIGS)])
        with server:
            ensure_loaded(server.grpc_url)
            memory_loaded = stub_memory(server)
            kv_dims = model_kv_shape(server.grpc_url, PLAIN)
            rows = measure_throughput(server.grpc_url, work, kv_dims, matrix["sizes"], matrix["concurrency"],
                                      args.steps, args.per_slot)
            previews = measure_previews(server.grpc_url, kv_dims, matrix["sizes"], matrix["concurrency"],
                                        args.steps, args.preview_rounds)
            memory_after = stub_memory(server)
    args.out.mkdir(parents=True, exist_ok=True)
    plotted = plot_throughput(rows, args.out / "streaming_serving.png")
    settings = {"steps": args.steps, "cond": COND_TOKENS, "uncond": UNCOND_TOKENS, "per_slot": args.per_slot,
                "x2_threads": args.x2_threads, "cores": os.cpu_count(), "checkpoint": args.checkpoint.name,
                "weights": checkpoint_bytes(args.checkpoint), "quick": args.quick,
                "minutes": (time.monotonic() - started) / 60, "load": (load_before, os.getloadavg()),
                "preview_rounds": args.preview_rounds}
    body = report_body(rows, previews, memory_loaded, memory_after, settings,
                       "streaming_serving.png" if plotted else None)
    write_report(args.out / "streaming_serving.md", "Continuous batching on Triton: one batching instance vs "
                 "one and two plain instances", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
