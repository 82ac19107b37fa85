"""Continuous batching: one `BatchingEngine` vs sequential solo generation, N concurrent requests.

    python -m bench.continuous_batching [--out bench] [--steps 8] [--threads 1] [--device cpu]
                                        [--geometries tiny,mid] [--sizes 256,512] [--counts 1,2,4,8]

For each geometry, size and N, the same N guided requests (own prefixes and noise) run once
one after another through `NeoPPPipeline.generate` and once submitted together to one engine
(wall time from the first submit to the last final image). Throughput ratio = sequential
seconds / batched seconds. "tiny" is the test checkpoint (2 layers, width 128), where a step is
mostly Python and kernel-launch overhead, so batching amortises overhead; "mid" is a random
4-layer, width-1024 tower (as bench/cfg_bench), where GEMMs dominate and batching gains only
what taller matrices win. Memory: resident set size (RSS) of the weights of one pipeline (all
concurrency served by one engine) vs two pipelines (two instances, weights twice), and the
peak while the engine runs N requests.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.common import REPO, PeakRSS, rss_bytes, write_report
from bench.step_efficiency import BenchGeometry, build_pipeline
from neopp.batch_engine import BatchingEngine
from neopp.modes import SamplingParams
from neopp.pipeline import GenerationRequest, NeoPPPipeline
from neopp.rng import NoiseStream
from testing.tiny_checkpoint import random_kv, tiny_config, write_tiny_checkpoint

PREFIX = 120
MID = BenchGeometry(layers=4)


def load(name: str, dtype: torch.dtype, device: str, root: Path) -> tuple[NeoPPPipeline, dict]:
    if name == "tiny":
        ckpt = write_tiny_checkpoint(root / "tiny", "dense", seed=1)
        return NeoPPPipeline.from_pretrained(ckpt, device=device, dtype=dtype), tiny_config("dense")
    return build_pipeline(MID, dtype, device), MID.config()


def requests(raw: dict, n: int, size: int, steps: int) -> list[GenerationRequest]:
    return [GenerationRequest(cond_kv=random_kv(raw, PREFIX + i, 10 + i), uncond_kv=random_kv(raw, 8, 50 + i),
                              index_offset_cond=PREFIX + i, index_offset_uncond=8, height=size, width=size,
                              noise=NoiseStream(i).draw(size, size), sampling=SamplingParams(infer_steps=steps))
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


def geometry_section(name: str, args: argparse.Namespace, dtype: torch.dtype, root: Path) -> str:
    base = rss_bytes()
    pipe, raw = load(name, dtype, args.device, root)
    one = rss_bytes() - base
    sizes: list[int] = []
    engine = BatchingEngine(pipe, token_budget=args.budget)
    engine.hooks.batch_size = sizes.append
    lines = [f"### {name}", "", "| size | N | sequential s | batched s | throughput ratio | images/s seq -> batched "
             "| mean requests per step | batched peak RSS over start (MiB) |", "|---|---|---|---|---|---|---|---|"]
    try:
        for size in args.sizes:
            batched(engine, requests(raw, 1, size, 2))  # warm-up of this size's kernels
            sequential(pipe, requests(raw, 1, size, 2))
            for n in args.counts:
                reqs = requests(raw, n, size, args.steps)
                seqs, bats = [], []
                for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both alike
                    seqs.append(sequential(pipe, reqs))
                    sizes.clear()
                    bats.append(batched(engine, reqs))
                seq, bat = statistics.median(seqs), statistics.median(bats)
                mean = sum(sizes) / max(1, len(sizes))
                peak_mib = "-"
                if n == max(args.counts):  # sampled in an untimed round: the sampler thread takes the GIL
                    with PeakRSS() as peak:
                        batched(engine, reqs)
                    peak_mib = f"{(peak.peak - base) / 2**20:.0f}"
                row = (f"| {size}x{size} | {n} | {seq:.2f} | {bat:.2f} | {seq / bat:.2f} | "
                       f"{n / seq:.2f} -> {n / bat:.2f} | {mean:.1f} | {peak_mib} |")
                print(row, flush=True)
                lines.append(row)
    finally:
        engine.close()
    with_one = rss_bytes()
    second, _ = load(name, dtype, args.device, root / "second")
    with_two = rss_bytes()
    lines += ["", f"Process RSS (MiB): one pipeline behind one engine (serves every concurrent request) "
              f"{with_one / 2**20:.0f}; plus a second pipeline (two instances: weights twice) {with_two / 2**20:.0f}; "
              f"the first pipeline's load added {one / 2**20:.0f}, the second {(with_two - with_one) / 2**20:.0f}."]
    del second, pipe, engine
    gc.collect()
    return "\n".join(lines)


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
    args = parser.parse_args(argv)
    args.sizes = [int(v) for v in args.sizes.split(",")]
    args.counts = [int(v) for v in args.counts.split(",")]
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    head = (f"{args.steps} steps, CFG on every step (scale 4), {args.dtype} on {args.device}, "
            f"{args.threads} thread(s), token budget {args.budget}, cond prefix {PREFIX}+i tokens, "
            f"uncond prefix 8. Sequential: `NeoPPPipeline.generate` per request; batched: all N submitted at "
            f"once to one `BatchingEngine`. Throughput ratio = sequential s / batched s; "
            f"seconds are the median of {args.repeats} interleaved rounds.")
    with tempfile.TemporaryDirectory() as tmp:
        sections = [geometry_section(g, args, dtype, Path(tmp)) for g in args.geometries.split(",")]
    return write_report(Path(args.out) / args.report, "Continuous batching: one engine vs sequential requests",
                        head + "\n\n" + "\n\n".join(sections))


if __name__ == "__main__":
    main()
