"""Triton serving NeoPP on one GPU, measured against the engine in-process in the same run.

    python -m bench.gpu_serve_check [--checkpoint DIR] [--config h200x1] [--sizes 1024,256]   (make gpu-serve-check)
    python -m bench.gpu_serve_check --device cpu --config "" --checkpoint build/tiny/dense --quick   # smoke run

1. What the machine has: the GPU, torch, the Python and its ``libpython`` (the Python backend's stub
   links it), the tritonserver found (the GPU bundle's under ``$NEOPP_TRITONSERVER_ROOT``).
2. A random-weight checkpoint of SenseNova-U1 8B's geometry, written once to ``build/8b`` (the
   benchmark writer), unless ``--checkpoint`` names one.
3. tritonserver with the layout ``--config`` serving ``neopp_dense`` and ``neopp_dense_stream``:
   per size, one request (CFG off, PNG, the real model's 300-token prefix) in-process, over gRPC
   and over system shared memory through the LightLLM client, interleaved round by round, with
   Triton's statistics splitting each request (client + wire, Triton core, Python-backend
   transfer, the model's own work); then one streamed request with previews.
4. A second server with one step-batching instance, one plain instance and two plain instances:
   perf_analyzer at each concurrency (images/s, p50, p99).

It prints one table with the goals (Triton over shared memory within 1.03x of in-process at
1024x1024 and 1.10x at 256x256; over gRPC within 1.10x at 1024x1024) and writes ``--report``.
"""

from __future__ import annotations

import argparse
import ctypes.util
import os
import platform
import shutil
import sysconfig
import time
from pathlib import Path

import torch

from bench.common import REPO, stats, write_report
from bench.serving_bench import MODEL, PATHS, breakdown_row, measure_latency
from bench.streaming_report import CONFIGS
from bench.streaming_serving import build_repository, ensure_loaded, first_previews, measure_throughput
from neopp.launcher.model_states import KEEP_GOING_ARGS
from neopp.launcher.triton_install import find_install
from neopp.launcher.tritonserver import TritonServer
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.model.speed import SpeedOptions
from neopp.modes import load_mode
from neopp.sampling.pipeline import NeoPPPipeline
from testing.tiny_checkpoint import random_kv

# (path, size) -> the most Triton may take over in-process (ratio of medians).
GOALS = {("Triton shared memory", 1024): 1.03, ("Triton shared memory", 256): 1.10, ("Triton gRPC", 1024): 1.10}
PREFIX_TOKENS = 300  # the real model's prefix in the KV-ingest and serving benchmarks
PINNED = SpeedOptions(attention_kernel="default")  # graphs as served; one attention kernel everywhere
# The Python backend's regions for requests and responses (44 MB of KV each, images back, a few
# instances): below this a request at the real geometry may not fit.
SHM_NEEDED = 1 << 30


def preflight() -> tuple[list[str], list[str]]:
    """(what the machine has, what stops the check)."""
    lines, fatal = [], []
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    lines.append(f"machine: {gpu}; torch {torch.__version__}; Python {platform.python_version()}; "
                 f"{os.cpu_count()} cores")
    version = f"{sysconfig.get_config_var('py_version_short')}"
    libdir = Path(sysconfig.get_config_var("LIBDIR") or "/usr/lib")
    shared = sysconfig.get_config_var("LDLIBRARY") or ""
    found = (libdir / shared).is_file() and shared.endswith(".so") or ctypes.util.find_library(f"python{version}")
    lines.append(f"libpython{version}.so (the stub links it): {'found' if found else 'MISSING'}")
    if not found:
        fatal.append(f"libpython{version}.so is not on this machine: the Python backend's stub cannot start "
                     f"(install the distribution's libpython{version} package)")
    import numpy

    compiler = shutil.which("cc") or shutil.which("gcc") or "none (FP8 quantisation then runs eagerly)"
    lines.append(f"numpy {numpy.__version__} (the Python backend's stub reads arrays as numpy 1.x lays them out); "
                 f"C compiler for torch.compile: {compiler}")
    if int(numpy.__version__.split(".")[0]) >= 2:
        fatal.append(f"numpy {numpy.__version__}: the stub needs numpy 1.x first on PYTHONPATH (the bundle's site/)")
    shm = shutil.disk_usage("/dev/shm").total if Path("/dev/shm").is_dir() else 0
    lines.append(f"/dev/shm: {shm / 2**30:.1f} GiB (the Python backend moves each request's tensors through it)")
    if shm < SHM_NEEDED:
        fatal.append(f"/dev/shm holds {shm / 2**20:.0f} MiB: a 1024x1024 request with the real prefix moves "
                     f"more than that through it (give the machine at least {SHM_NEEDED / 2**30:.0f} GiB)")
    try:
        install = find_install()
        lines.append(f"tritonserver: {install.server_bin}")
    except Exception as exc:  # noqa: BLE001 - said, and the check stops
        fatal.append(f"no tritonserver: {exc} (make gpu-bundle here, then NEOPP_TRITONSERVER_ROOT there)")
    return lines, fatal


def checkpoint(path: Path | None, layers: int) -> Path:
    """The named checkpoint, or the 8B-geometry random one (written once, ~14 GB)."""
    if path is not None:
        return path
    from bench.eight_b import ensure_checkpoint

    ckpt = REPO / "build" / "8b"
    total, seconds = ensure_checkpoint(ckpt, layers, "cuda" if torch.cuda.is_available() else "cpu")
    print(f"checkpoint {ckpt}: {total / 2**30:.1f} GiB" + (f", written in {seconds:.0f} s" if seconds else ""),
          flush=True)
    return ckpt


def server_args(config: str, models: list[str]) -> list[str]:
    """GPU metrics off: the bundle carries DCGM's library, not its modules, and nothing here reads them."""
    return ["--model-control-mode=explicit", *KEEP_GOING_ARGS, "--allow-gpu-metrics=false",
            *(f"--load-model={m}" for m in models), *([f"--model-config-name={config}"] if config else [])]


def server_env(ckpt: Path) -> dict[str, str]:
    """Every model on torch's own attention kernel pick, as the in-process engine: a kernel measured
    fastest in each process could differ between them, and then so would the bytes and the time."""
    return dict(os.environ, NEOPP_CHECKPOINT=str(ckpt), NEOPP_BASE_DIR=str(REPO),
                NEOPP_ATTENTION_KERNEL=PINNED.attention_kernel)


def latency(args: argparse.Namespace, ckpt: Path, work: Path) -> list[str]:
    """Per size: the four paths' median ms, ratios and breakdown; then a streamed request's times."""
    server = TritonServer(REPO / "model_repository", env=server_env(ckpt), log_path=work / "tritonserver_latency.log",
                          extra_args=server_args(args.config, [MODEL, CONFIGS[0][1]]))
    cfg = CheckpointConfig.from_checkpoint(ckpt)
    layers, kv_heads, head_dim = cfg.kv_dims
    raw = {"llm_config": {"num_hidden_layers": layers, "num_key_value_heads": kv_heads, "head_dim": head_dim}}
    kv = random_kv(raw, args.tokens, seed=1)
    lines = []
    with server:
        ensure_loaded(server.grpc_url, models=[MODEL, CONFIGS[0][1]])
        pipe = NeoPPPipeline.from_pretrained(ckpt, load_mode(REPO / "configs/neopp/neopp_dense.json"), args.device,
                                             speed=PINNED)
        for size in args.sizes:
            label = f"{args.tokens} tokens"
            result, parts = measure_latency(server, pipe, {label: kv}, size, args.steps, args.rounds)
            base = stats(result["times"][(label, PATHS[0])])[0]
            lines += [f"{size}x{size}, {args.steps} steps (same picture on every path: "
                      f"{'yes' if result['same_bytes'] else 'NO'}):"]
            for (_, path), values in result["times"].items():
                med = stats(values)[0]
                goal = GOALS.get((path, size))
                verdict = "" if goal is None else f"  goal <= {goal:.2f}: {'met' if med / base <= goal else 'MISSED'}"
                lines.append(f"  {path:<42} {med * 1e3:9.1f} ms  x{med / base:.3f}{verdict}")
            lines += ["  where a Triton request's time goes (ms): total | client + wire | Triton core | "
                      "Python-backend transfer | model"]
            lines += ["  " + breakdown_row(path, samples) for (_, path), samples in parts.items()]
        del pipe
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the servers' stubs need the card, not this process's cache
        for size in args.sizes:
            first, image = first_previews(server.grpc_url, cfg.kv_dims, size, args.steps, 1)[0]
            lines.append(f"streamed {size}x{size} with a preview every step: first preview {first * 1e3:.0f} ms, "
                         f"image {image * 1e3:.0f} ms")
    return lines


def throughput(args: argparse.Namespace, ckpt: Path, work: Path) -> list[str]:
    """One batching instance vs one and two plain instances, through Triton with perf_analyzer."""
    repo = build_repository(work / "repo", args.x2_threads, args.config)
    server = TritonServer(repo, env=server_env(ckpt), log_path=work / "tritonserver_throughput.log",
                          extra_args=server_args(args.config, [m for _, m in CONFIGS]))
    cfg = CheckpointConfig.from_checkpoint(ckpt)
    with server:
        ensure_loaded(server.grpc_url)
        rows = measure_throughput(server.grpc_url, work, cfg.kv_dims,
                                  args.batching_sizes, args.concurrency, args.batching_steps, args.per_slot,
                                  args.perf_timeout)
    lines = [f"throughput through Triton (perf_analyzer over gRPC, guided, {args.batching_steps} steps): "
             "images/s, p50 ms, p99 ms"]
    for size in args.batching_sizes:
        for c in args.concurrency:
            cells = [f"{label} {rows[(label, size, c)].infer_s:6.2f}/s {rows[(label, size, c)].p50_ms:7.0f} "
                     f"{rows[(label, size, c)].p99_ms:7.0f}" for label, _ in CONFIGS]
            lines.append(f"  {size}x{size} concurrency {c}: " + " | ".join(cells))
    return lines


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="the in-process engine's device (the server's model picks "
                   "its own from the layout)")
    p.add_argument("--config", default="h200x1", help="the layout (--model-config-name); empty: config.pbtxt")
    p.add_argument("--checkpoint", type=Path, default=None, help="default: a random 8B-geometry one in build/8b")
    p.add_argument("--layers", type=int, default=36, help="layers of the random checkpoint")
    p.add_argument("--sizes", default="1024,256")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--tokens", type=int, default=PREFIX_TOKENS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batching-sizes", default="256")
    p.add_argument("--batching-steps", type=int, default=8)
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--per-slot", type=int, default=1, help="perf_analyzer requests per concurrent slot (8 at least)")
    p.add_argument("--perf-timeout", type=float, default=120.0, help="seconds one perf_analyzer point may take")
    p.add_argument("--x2-threads", type=int, default=0, help="torch threads of each plain instance of two")
    p.add_argument("--quick", action="store_true", help="one round, one size, concurrency 1 and 2 (smoke run)")
    p.add_argument("--out", type=Path, default=REPO / "bench")
    p.add_argument("--report", default="gpu_serving.md")
    p.add_argument("--work", type=Path, default=REPO / "build" / "gpu-serve", help="server logs and perf data "
                   "(kept: a run cut short leaves them)")
    a = p.parse_args(argv)
    a.sizes, a.batching_sizes = ([int(v) for v in text.split(",") if v] for text in (a.sizes, a.batching_sizes))
    a.concurrency = [int(v) for v in a.concurrency.split(",") if v]
    if a.quick:
        a.sizes, a.batching_sizes, a.concurrency, a.rounds = a.sizes[-1:], a.batching_sizes[:1], [1, 2], 1
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.monotonic()
    lines, fatal = preflight()
    print("\n".join(lines), flush=True)
    if fatal:
        print("\n".join(f"cannot run: {why}" for why in fatal))
        return 2
    ckpt = checkpoint(args.checkpoint, args.layers)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    for measure in (latency, throughput):
        part = measure(args, ckpt, args.work)
        print("\n".join(part), flush=True)
        lines += part
        lines.append(f"[{time.monotonic() - started:.0f} s]")
        report(args, lines)  # after each part: a run cut short keeps what it measured
    return 0


def report(args: argparse.Namespace, lines: list[str]) -> None:
    write_report(args.out / args.report, "Triton on one GPU: serving cost and throughput",
                 "```text\n" + "\n".join(lines) + "\n```")


if __name__ == "__main__":
    raise SystemExit(main())
