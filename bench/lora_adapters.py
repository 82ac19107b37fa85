"""LoRA per request: the step time of a batch of 4 requests on the base model, all on one adapter,
and on 4 different adapters, at ranks 16 and 64, on a slice of the 8B geometry; and the memory
each resident adapter takes.

    python -m bench.lora_adapters [--out bench] [--layers 1] [--size 256] [--repeats 5]

The slice is the 8B tower's full widths with fewer layers (the per-layer cost is what an adapter
adds to). Adapters target every decoder-layer linear (attention and MLP). The three batches are
timed in rotation in one process, so drift on a shared machine falls on all of them alike.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from bench.common import section_main, stats, timed
from bench.geometry import EIGHT_B
from bench.step_efficiency import build_pipeline
from neopp.model.adapters import tower_linears
from neopp.modes import SamplingParams
from neopp.request import GenerationRequest
from neopp.sampling.batching import StepBatcher, start
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing.tiny_checkpoint import random_kv
from testing.tiny_lora import write_adapter

BATCH = 4
RANKS = (16, 64)
MIB = 2**20


def requests(raw_config: dict, size: int, adapters: list[str | None]) -> list[GenerationRequest]:
    """One unguided request per adapter name (None: the base model), each with its own prefix."""
    out = []
    for i, name in enumerate(adapters):
        kv = random_kv(raw_config, 64, seed=i)
        out.append(GenerationRequest(cond_kv=kv, index_offset_cond=64, height=size, width=size,
                                     noise=NoiseStream(i).draw(size, size), lora=name,
                                     sampling_params=SamplingParams(infer_steps=1000, enable_cfg=False)))
    return out


def step_timer(pipe: NeoPPPipeline, reqs: list[GenerationRequest]):
    batcher = StepBatcher(pipe)
    active = [start(pipe, i, r) for i, r in enumerate(reqs)]
    return lambda: batcher.step(active)


def body(args) -> str:
    geo = replace(EIGHT_B, layers=args.layers)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pipe = build_pipeline(geo, dtype, device)
    weights = {k: lin.weight for k, lin in tower_linears(pipe.transformer).items()}
    rows, memory = [], []
    with tempfile.TemporaryDirectory() as folder:
        for rank in RANKS:
            names = [f"r{rank}_{i}" for i in range(BATCH)]
            for i, name in enumerate(names):
                write_adapter(Path(folder), name, weights, sorted(weights), rank=rank, seed=i)
            pipe.use_adapter_dir(folder, max_bytes=1 << 40)
            cases = {"base": [None] * BATCH, "one adapter": [names[0]] * BATCH, "4 adapters": names}
            runs = {label: step_timer(pipe, requests(geo.config(), args.size, ads)) for label, ads in cases.items()}
            times: dict[str, list[float]] = {label: [] for label in runs}
            for _ in range(args.repeats):
                for label, run in runs.items():
                    times[label] += timed(run, 1, warmup=0 if times[label] else 1)
            base_med, base_min, _ = stats(times["base"])
            for label, values in times.items():
                med, low, high = stats(values)
                rows.append(f"| {rank} | {label} | {med * 1e3:.0f} | {low * 1e3:.0f}..{high * 1e3:.0f} | "
                            f"{med / base_med:.3f} | {low / base_min:.3f} |")
            one = pipe.adapters.get(names[0]).nbytes
            memory.append(f"| {rank} | {one / MIB:.1f} | {one / args.layers * EIGHT_B.layers / MIB:.0f} |")
    tokens = (args.size // 32) ** 2
    return (f"Slice of the 8B geometry: {args.layers} layer(s) of width {geo.hidden} (MLP {geo.mlp}), {dtype} on "
            f"{device}; a batch of {BATCH} unguided {args.size}x{args.size} requests ({tokens} tokens each); "
            f"{args.repeats} steps per case, timed in rotation. Other work on a shared machine only adds time, "
            "so the minima are the least disturbed samples.\n\n"
            "| rank | batch | step ms (median) | min..max | vs base (medians) | vs base (minima) |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(rows)
            + "\n\nMemory of one resident adapter (every layer linear targeted; factors in the run dtype):\n\n"
            "| rank | MiB on this slice | MiB on the 36-layer tower |\n|---|---|---|\n" + "\n".join(memory))


def main(argv: list[str] | None = None) -> None:
    section_main(argv, __doc__, "lora_adapters.md", "LoRA per request: step cost and adapter memory", body,
                 layers=1, size=256, repeats=5)


if __name__ == "__main__":
    main()
