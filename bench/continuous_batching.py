"""Continuous batching: one `BatchingEngine` vs sequential solo generation, N concurrent requests.

    python -m bench.continuous_batching [--out bench] [--steps 8] [--threads 1] [--device cpu]
                                        [--geometries tiny,mid] [--sizes 256,512] [--counts 1,2,4,8]
                                        [--two-instances]
    python -m bench.continuous_batching --device cuda --dtype bfloat16 --geometries 8b --two-instances

For each geometry, size and N, the same N guided requests (own prefixes and noise) run once
one after another through `NeoPPPipeline.generate` and once submitted together to one engine
(wall time from the first submit to the last final image). Throughput ratio = sequential
seconds / batched seconds. "tiny" is the test checkpoint (2 layers, width 128), where a step is
mostly Python and kernel-launch overhead, so batching amortises overhead; "mid" is a random
4-layer, width-1024 tower (as bench/cfg_bench), where GEMMs dominate and batching gains only
what taller matrices win; "8b" is SenseNova-U1 8B's generation tower, random, drawn on the device
(for GPUs). `--two-instances` adds two plain instances: two processes sharing the device, each
with its own pipeline, as two Triton instances of the plain model. Memory: resident set size
(RSS; allocated device memory on a GPU) of the weights of one pipeline (all concurrency served
by one engine) vs two pipelines (two instances, weights twice), and the peak while the engine
runs N requests.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import threading
import time
from pathlib import Path

import torch

from bench.common import REPO, PeakRSS, rss_bytes, write_report
from bench.geometry import EIGHT_B, BenchGeometry, random_tower_tensors
from bench.instances import TwoInstances
from bench.step_efficiency import build_pipeline
from neopp.engines.batch_engine import BatchingEngine
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.model.transformer import NeoPPTransformer
from neopp.modes import ModeSpec, SamplingParams
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing.tiny_checkpoint import random_kv, tiny_config, tiny_tensors

PREFIX = 120
MID = BenchGeometry(layers=4)


def load(name: str, dtype: torch.dtype, device: str) -> tuple[NeoPPPipeline, dict]:
    """The geometry's random tower: "tiny" (the test checkpoint's), "mid", or "8b" (SenseNova-U1 8B's
    generation tower, drawn on the device)."""
    dev = torch.device(device)
    if name == "mid":
        return build_pipeline(MID, dtype, device), MID.config()
    raw = tiny_config("dense") if name == "tiny" else EIGHT_B.config()
    cfg = CheckpointConfig.from_dict(raw)
    tensors = tiny_tensors(raw, seed=1) if name == "tiny" else random_tower_tensors(cfg, dev, dtype)
    return NeoPPPipeline(cfg, NeoPPTransformer.from_tensors(cfg, tensors, dev, dtype), ModeSpec(), dev, dtype), raw


def requests(raw: dict, n: int, size: int, steps: int) -> list[GenerationRequest]:
    return [GenerationRequest(cond_kv=random_kv(raw, PREFIX + i, 10 + i), uncond_kv=random_kv(raw, 8, 50 + i),
                              index_offset_cond=PREFIX + i, index_offset_uncond=8, height=size, width=size,
                              noise=NoiseStream(i).draw(size, size), sampling_params=SamplingParams(infer_steps=steps))
            for i in range(n)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sequential(pipe: NeoPPPipeline, reqs: list[GenerationRequest]) -> float:
    sync()
    start = time.perf_counter()
    for r in reqs:
        pipe.generate(r)
    sync()
    return time.perf_counter() - start


def batched(engine: BatchingEngine, reqs: list[GenerationRequest]) -> float:
    left, done = [len(reqs)], threading.Event()

    def emit(ev) -> None:
        if ev.error is not None:
            raise RuntimeError(f"benchmark request failed: {ev.error}")
        if ev.last:
            left[0] -= 1
            if not left[0]:
                done.set()

    start = time.perf_counter()
    for r in reqs:
        engine.submit(r, emit, lambda: False)
    if not done.wait(3600):
        raise RuntimeError("benchmark requests did not finish within an hour")
    return time.perf_counter() - start


def device_bytes(device: str) -> int:
    """Memory the process holds: allocated device memory on a GPU, else the resident set."""
    return torch.cuda.memory_allocated() if device.startswith("cuda") else rss_bytes()


def cell(pipe: NeoPPPipeline, engine: BatchingEngine, two: TwoInstances | None, raw: dict, n: int, size: int,
         args: argparse.Namespace, sizes: list[int]) -> tuple[float, float, float | None]:
    """Median seconds of one plain instance, one engine and (optionally) two plain instances."""
    reqs = requests(raw, n, size, args.steps)
    seqs, bats, twos = [], [], []
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits every column alike
        seqs.append(sequential(pipe, reqs))
        sizes.clear()
        bats.append(batched(engine, reqs))
        if two is not None:
            twos.append(two.run(size, n, args.steps))
    return statistics.median(seqs), statistics.median(bats), statistics.median(twos) if twos else None


def geometry_section(name: str, args: argparse.Namespace, dtype: torch.dtype) -> str:
    base = device_bytes(args.device)
    pipe, raw = load(name, dtype, args.device)
    one = device_bytes(args.device) - base
    two = TwoInstances(load, requests, name, args.dtype, args.device, args.threads) if args.two_instances else None
    sizes: list[int] = []
    engine = BatchingEngine(pipe, token_budget=args.budget)
    engine.hooks.batch_size = sizes.append
    unit = "device MiB" if args.device.startswith("cuda") else "RSS MiB"
    lines = [f"### {name}", "", "| size | N | sequential s | batched s | throughput ratio "
             "| images/s seq -> batched | two instances s | throughput batched / two | mean requests per step "
             f"| batched peak {unit} over start |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    try:
        for size in args.sizes:
            batched(engine, requests(raw, 1, size, 2))  # warm-up of this size's kernels
            sequential(pipe, requests(raw, 1, size, 2))
            if two is not None:
                two.run(size, 2, 2)
            for n in args.counts:
                seq, bat, pair = cell(pipe, engine, two, raw, n, size, args, sizes)
                mean = sum(sizes) / max(1, len(sizes))
                peak = "-"
                if n == max(args.counts):
                    peak = f"{(batched_peak(engine, raw, n, size, args) - base) / 2**20:.0f}"
                pair_cols = f"{pair:.2f} | {pair / bat:.2f}" if pair is not None else "- | -"
                row = (f"| {size}x{size} | {n} | {seq:.2f} | {bat:.2f} | {seq / bat:.2f} | "
                       f"{n / seq:.2f} -> {n / bat:.2f} | {pair_cols} | {mean:.1f} | {peak} |")
                print(row, flush=True)
                lines.append(row)
    finally:
        engine.close()
        if two is not None:
            two.close()
    lines += ["", weights_line(name, args, dtype, one, two)]
    del pipe, engine
    gc.collect()
    return "\n".join(lines)


def batched_peak(engine: BatchingEngine, raw: dict, n: int, size: int, args: argparse.Namespace) -> float:
    """Peak bytes while the engine runs N requests (an untimed round: the RSS sampler takes the GIL)."""
    reqs = requests(raw, n, size, args.steps)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        batched(engine, reqs)
        return torch.cuda.max_memory_allocated()
    with PeakRSS() as peak:
        batched(engine, reqs)
    return peak.peak


def weights_line(name: str, args: argparse.Namespace, dtype: torch.dtype, one: int,
                 two: TwoInstances | None) -> str:
    if two is not None and args.device.startswith("cuda"):
        each = ", ".join(f"{b / 2**20:.0f}" for b in two.weight_bytes)
        return (f"Device memory after load (MiB): one pipeline (one engine serves every concurrent request) "
                f"{one / 2**20:.0f}; the two plain instances hold {each}.")
    with_one = rss_bytes()
    second, _ = load(name, dtype, args.device)
    with_two = rss_bytes()
    del second
    return (f"Process RSS (MiB): one pipeline behind one engine (serves every concurrent request) "
            f"{with_one / 2**20:.0f}; plus a second pipeline (two instances: weights twice) {with_two / 2**20:.0f}; "
            f"the first pipeline's load added {one / 2**20:.0f}, the second {(with_two - with_one) / 2**20:.0f}.")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "bench"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=3, help="rounds per cell (median reported)")
    parser.add_argument("--budget", type=int, default=16384, help="token budget of the engine")
    parser.add_argument("--geometries", default="tiny,mid")
    parser.add_argument("--sizes", default="256,512")
    parser.add_argument("--counts", default="1,2,4,8")
    parser.add_argument("--report", default="continuous_batching.md")
    parser.add_argument("--two-instances", action="store_true",
                        help="also time two plain instances (two processes, weights twice) on the same device")
    args = parser.parse_args(argv)
    args.sizes = [int(v) for v in args.sizes.split(",")]
    args.counts = [int(v) for v in args.counts.split(",")]
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    head = (f"{args.steps} steps, CFG on every step (scale 4), {args.dtype} on {args.device}, "
            f"{args.threads} thread(s), token budget {args.budget}, cond prefix {PREFIX}+i tokens, "
            f"uncond prefix 8. Sequential: `NeoPPPipeline.generate` per request; batched: all N submitted at "
            f"once to one `BatchingEngine`; two instances: two processes, each with its own pipeline, each "
            f"generating half the N one after another. Throughput ratio = sequential s / batched s; "
            f"seconds are the median of {args.repeats} interleaved rounds.")
    sections = [geometry_section(g, args, dtype) for g in args.geometries.split(",")]
    return write_report(Path(args.out) / args.report, "Continuous batching: one engine vs sequential requests",
                        head + "\n\n" + "\n\n".join(sections))


if __name__ == "__main__":
    main()
