"""Three-branch (image-editing) guidance on 2 CFG ranks: which branch shares a rank with which.

    python -m bench.cfg_layout [--out bench] [--size 1024] [--steps 4] [--repeats 10]

One rank carries two of the three branches (batched), so a step costs what that rank costs. The
three pairings that keep cond on rank 0 (where unguided steps run it) are timed side by side in
one run: 2 rank processes x 1 thread, the tiny checkpoint in float32 on the CPU, layouts
interleaved round by round so machine load hits each alike. Prefix lengths follow an edit of
one input image at the output size: cond = prompt + image, image = the image alone, uncond = the
empty prompt. Step times are rank 0's (every rank waits for the others at the gather); on a
shared machine the minimum is the steadier figure, so both are compared.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as tmp

from bench.common import section_main, stats
from neopp.modes import ModeSpec, SamplingParams
from neopp.ports import free_ports
from neopp.request import GenerationRequest
from neopp.sampling.rng import NoiseStream
from testing.tiny_checkpoint import random_kv, tiny_config, write_tiny_checkpoint

LAYOUTS = {"cond / uncond+image": (("cond",), ("uncond", "image")),
           "cond+uncond / image": (("cond", "uncond"), ("image",)),
           "cond+image / uncond": (("cond", "image"), ("uncond",))}
PROMPT, UNCOND_PREFIX = 40, 12
MODE = ModeSpec(name="cfg2", cfg_p_size=2)


def prefix_lengths(size: int) -> dict[str, int]:
    image = (size // 32) ** 2 + 2  # the input image's tokens and its delimiters
    return {"cond": PROMPT + image, "uncond": UNCOND_PREFIX, "image": image}


def bench_request(size: int, steps: int) -> GenerationRequest:
    raw, n = tiny_config("dense"), prefix_lengths(size)
    return GenerationRequest(cond_kv=random_kv(raw, n["cond"], 1), index_offset_cond=n["cond"],
                             uncond_kv=random_kv(raw, n["uncond"], 2), index_offset_uncond=n["uncond"],
                             image_kv=random_kv(raw, n["image"], 3), index_offset_image=n["image"],
                             height=size, width=size, noise=NoiseStream(0).draw(size, size),
                             sampling_params=SamplingParams(infer_steps=steps + 1, cfg_scale=4.0,
                                                            image_guidance_scale=2.0))


def _rank(rank: int, port: int, ckpt: str, size: int, steps: int, repeats: int, out) -> None:
    torch.set_num_threads(1)
    from neopp.parallel.mesh import init_mesh
    from neopp.parallel.parallel_pipeline import ParallelPipeline
    from neopp.parallel.rank_step import rank_request

    mesh = init_mesh(MODE, rank, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"), 120)
    pipe = ParallelPipeline.from_pretrained(ckpt, MODE, mesh, "cpu", torch.float32)
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    names = list(LAYOUTS)
    for i in range(repeats):
        for name in names[i % 3:] + names[:i % 3]:  # a different layout first in each round
            layout = LAYOUTS[name]
            pipe.three_branch_split = layout
            req = rank_request(MODE, bench_request(size, steps), rank, layout)
            step: list[float] = []
            pipe.sample(req, on_step=lambda _k, s, step=step: step.append(s))
            times[name].extend(step[1:])  # the first step warms up
    out.put((rank, times))


def measure(size: int, steps: int, repeats: int) -> dict[str, list[float]]:
    ctx = tmp.get_context("spawn")
    out = ctx.Queue()
    port = free_ports(1)[0]
    with tempfile.TemporaryDirectory() as folder:
        ckpt = write_tiny_checkpoint(Path(folder) / "dense", "dense")
        procs = [ctx.Process(target=_rank, args=(r, port, str(ckpt), size, steps, repeats, out)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            got = dict(out.get(timeout=1800) for _ in procs)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return got[0]


def run(args: argparse.Namespace) -> str:
    sections = []
    for size in (args.size // 2, args.size):
        times = measure(size, args.steps, args.repeats)
        base = stats(times[next(iter(LAYOUTS))])
        rows = []
        for name, values in times.items():
            med, lo, hi = stats(values)
            rows.append(f"| {name} | {med * 1e3:.2f} ({lo * 1e3:.2f}-{hi * 1e3:.2f}) | {med / base[0]:.2f} "
                        f"| {lo / base[1]:.2f} |")
        by_median = min(times, key=lambda k: stats(times[k])[0])
        by_min = min(times, key=lambda k: stats(times[k])[1])
        rows.append(f"\nFastest by median: {by_median}; by minimum: {by_min}; the layouts differ by "
                    f"{max(stats(v)[0] for v in times.values()) / min(stats(v)[0] for v in times.values()) - 1:.0%} "
                    "at most (median).")
        n = prefix_lengths(size)
        sections.append(f"### {size}x{size} ({(size // 32) ** 2} image tokens; prefixes cond {n['cond']}, "
                        f"image {n['image']}, uncond {n['uncond']})\n\n| rank 0 / rank 1 | ms per step, median "
                        f"(min-max) | median vs {next(iter(LAYOUTS))} | min vs same |\n|---|---|---|---|\n"
                        + "\n".join(rows))
    from neopp.parallel.parallel_pipeline import THREE_BRANCH_SPLIT

    used = next(name for name, layout in LAYOUTS.items() if layout == THREE_BRANCH_SPLIT)
    sections.append(f"The engine runs {used} (`neopp.parallel.parallel_pipeline.THREE_BRANCH_SPLIT`).")
    return (f"Tiny checkpoint, float32, CPU, 2 ranks x 1 thread; cfg_scale 4, image_guidance_scale 2 (all three "
            f"branches on every step); {args.steps} timed steps x {args.repeats} rounds, layouts interleaved.\n\n"
            + "\n\n".join(sections))


def main(argv: list[str] | None = None) -> None:
    section_main(argv, __doc__, "cfg_layout.md", "Three-branch guidance on 2 CFG ranks: branch pairing", run,
                 size=1024, steps=4, repeats=10)


if __name__ == "__main__":
    main()
