"""Guidance cost: sequential CFG vs batched CFG on one device vs CFG-parallel on two ranks.

    python -m bench.cfg_bench [--out bench] [--layers 4] [--size 512] [--steps 4]

Same request, same weights (a random mid-size tower written once as a checkpoint, since the
ranks load it from disk), measured in one run: one process with 1 thread (sequential and
batched), one process with 2 threads (same total threads as the two ranks), and 2 ranks x 1
thread. Also reports the seconds each rank spends in collectives per step.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common import section_main, stats
from bench.geometry import BenchGeometry
from neopp.engines.factory import build_engine
from neopp.engines.spec import EngineSpec
from neopp.modes import ModeSpec, SamplingParams
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing.tiny_checkpoint import random_kv, tiny_tensors

PREFIX, UNCOND_PREFIX = 300, 12


def write_checkpoint(geo: BenchGeometry, root: Path, dtype: torch.dtype) -> Path:
    raw = geo.config()
    tensors = tiny_tensors(raw, seed=1, mlp_width=geo.mlp, head_width=geo.head_width)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(raw))
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"))
    return root


def bench_request(geo: BenchGeometry, size: int, steps: int) -> GenerationRequest:
    raw = geo.config()
    return GenerationRequest(cond_kv=random_kv(raw, PREFIX, 1), uncond_kv=random_kv(raw, UNCOND_PREFIX, 2),
                             index_offset_cond=PREFIX, index_offset_uncond=UNCOND_PREFIX, height=size, width=size,
                             noise=NoiseStream(0).draw(size, size),
                             sampling_params=SamplingParams(infer_steps=steps + 1))


def per_step(run) -> list[float]:
    """Step seconds of one generation, first step (warm-up) dropped."""
    out: list[float] = []
    run(lambda k, s: out.append(s))
    return out[1:]


def measure(ckpt: Path, req: GenerationRequest, dtype: torch.dtype, repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    pipe = NeoPPPipeline.from_pretrained(ckpt, ModeSpec(), "cpu", dtype)
    pool = build_engine(EngineSpec.local(ckpt, ModeSpec(name="cfg2", cfg_p_size=2), dtype=dtype, threads=1))
    comm: list[float] = []
    try:
        for _ in range(repeats):  # interleaved, so machine load hits every variant alike
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for batching in ("off", "on"):
                    pipe.cfg_batching = batching
                    label = f"{'batched' if batching == 'on' else 'sequential'} CFG, 1 process x {threads} thread"
                    times.setdefault(label, []).extend(per_step(lambda cb: pipe.sample(req, on_step=cb)))
            comm_before = pool.comm_seconds
            steps = per_step(lambda cb: pool.generate(req, on_step=cb))
            times.setdefault("CFG-parallel, 2 ranks x 1 thread", []).extend(steps)
            comm.append((pool.comm_seconds - comm_before) / (len(steps) + 1))
    finally:
        pool.close()
    times["collectives per step (rank 0)"] = comm
    return times


def run(args: argparse.Namespace) -> str:
    geo, size, steps, repeats = BenchGeometry(layers=args.layers), args.size, args.steps, args.repeats
    sections = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in (torch.float32, torch.bfloat16):
            ckpt = write_checkpoint(geo, Path(tmp) / str(dtype), dtype)
            times = measure(ckpt, bench_request(geo, size, steps), dtype, repeats)
            base = stats(times["sequential CFG, 1 process x 1 thread"])[0]
            rows = []
            for label, values in times.items():
                med, lo, hi = stats(values)
                ratio = f"{med / base:.2f}" if "collectives" not in label else "-"
                rows.append(f"| {label} | {med * 1e3:.1f} ({lo * 1e3:.1f}-{hi * 1e3:.1f}) | {ratio} |")
            sections.append(f"### {str(dtype).split('.')[-1]}\n\n| variant | ms per step, median (min-max) | "
                            "vs sequential 1x1 |\n|---|---|---|\n" + "\n".join(rows))
    return (f"Geometry: {geo}; image {size}x{size}, cond prefix {PREFIX}, uncond prefix {UNCOND_PREFIX}, "
            f"CFG on every step; {steps} timed steps x {repeats} rounds, variants interleaved.\n\n"
            + "\n\n".join(sections))


def main(argv: list[str] | None = None) -> None:
    section_main(argv, __doc__, "cfg.md", "Guidance: sequential vs batched vs CFG-parallel", run,
                 layers=4, size=512, steps=4, repeats=3)


if __name__ == "__main__":
    main()
