"""How a step grows with image tokens L and prefix length S, and what a generation keeps resident.

    python -m bench.scaling [--out bench] [--layers 4]

Writes `scaling.md` and `scaling.png`. Growth is fitted as a power law (log-log slope) over the
measured points. Peak memory is measured in a fresh child process per dtype (ru_maxrss above
the process's own baseline) and compared with weights + KV buffers + one layer's activations.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.cfg_bench import write_checkpoint
from bench.common import REPO, PeakRSS, rss_bytes, save_figure, section_main, stats
from bench.geometry import BenchGeometry
from bench.step_efficiency import build_pipeline
from neopp.modes import SamplingParams
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing.tiny_checkpoint import random_kv

SIZES = (256, 512, 768, 1024)        # L = 64, 256, 576, 1024 tokens
PREFIXES = (1, 300, 1000, 3000)


def step_ms(pipe, size: int, prefix: int, steps: int) -> tuple[float, float, float]:
    raw = {"llm_config": {"num_hidden_layers": pipe.config.num_layers, "num_key_value_heads": pipe.config.num_kv_heads,
                          "head_dim": pipe.config.head_dim}}
    req = GenerationRequest(cond_kv=random_kv(raw, prefix, 0), index_offset_cond=prefix, height=size, width=size,
                            noise=NoiseStream(0).draw(size, size),
                            sampling_params=SamplingParams(infer_steps=steps + 1, enable_cfg=False))
    times: list[float] = []
    pipe.sample(req, on_step=lambda k, s: times.append(s))
    return tuple(t * 1e3 for t in stats(times[1:]))


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares exponent of y ~ x^p."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def scaling_section(geo: BenchGeometry, steps: int, out_dir: Path) -> str:
    lines, series = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        pipe = build_pipeline(geo, dtype)
        by_l = [(size, (size // 32) ** 2, step_ms(pipe, size, 300, steps)) for size in SIZES]
        by_s = [(prefix, step_ms(pipe, 512, prefix, steps)) for prefix in PREFIXES]
        series[name] = (by_l, by_s)
        p_l = slope([n for _, n, _ in by_l], [m[0] for _, _, m in by_l])
        p_s = slope([s + 256 for s, _ in by_s], [m[0] for _, m in by_s])
        lines.append(f"### {name}\n\n| image | L | ms per step (prefix 300) |\n|---|---|---|\n" +
                     "\n".join(f"| {sz}x{sz} | {n} | {m[0]:.1f} ({m[1]:.1f}-{m[2]:.1f}) |" for sz, n, m in by_l) +
                     f"\n\nFitted growth in L: step ~ L^{p_l:.2f}.\n\n| prefix S | ms per step (512x512, L=256) |\n"
                     "|---|---|\n" + "\n".join(f"| {s} | {m[0]:.1f} ({m[1]:.1f}-{m[2]:.1f}) |" for s, m in by_s) +
                     f"\n\nFitted growth in the attended length S+L: step ~ (S+L)^{p_s:.2f}.")
        del pipe
    _plot(series, out_dir / "scaling.png")
    return "\n\n".join(lines) + "\n\n![scaling](scaling.png)"


def _plot(series: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, (by_l, by_s) in series.items():
        a.errorbar([n for _, n, _ in by_l], [m[0] for *_, m in by_l],
                   yerr=[[m[0] - m[1] for *_, m in by_l], [m[2] - m[0] for *_, m in by_l]], marker="o", label=name)
        b.errorbar([s for s, _ in by_s], [m[0] for _, m in by_s],
                   yerr=[[m[0] - m[1] for _, m in by_s], [m[2] - m[0] for _, m in by_s]], marker="o", label=name)
    a.set(xlabel="image tokens L (prefix 300)", ylabel="ms per step", xscale="log", yscale="log")
    b.set(xlabel="prefix tokens S (L = 256)", ylabel="ms per step", xscale="symlog", yscale="log")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    save_figure(fig, path, "NeoPP step time (one branch)")


def memory_child(ckpt: str, layers: int, dtype_name: str, size: int, prefix: int) -> dict:
    """Run in a fresh process: RSS before loading the checkpoint, after it, and at the peak of a generation."""
    import gc

    dtype = getattr(torch, dtype_name)
    geo = BenchGeometry(layers=layers)
    raw = geo.config()
    req = GenerationRequest(cond_kv=random_kv(raw, prefix, 0), uncond_kv=random_kv(raw, 12, 1),
                            index_offset_cond=prefix, index_offset_uncond=12, height=size, width=size,
                            noise=NoiseStream(0).draw(size, size), sampling_params=SamplingParams(infer_steps=2))
    gc.collect()
    base = rss_bytes()
    pipe = NeoPPPipeline.from_pretrained(ckpt, device="cpu", dtype=dtype)
    gc.collect()
    loaded = rss_bytes()
    with PeakRSS() as peak:
        pipe.sample(req)
    weights = sum(t.numel() * t.element_size() for t in _tensors(pipe.transformer))
    L, D, el = (size // 32) ** 2, geo.hidden, torch.tensor([], dtype=dtype).element_size()
    kv = 2 * layers * 2 * geo.kv_heads * geo.head_dim * ((prefix + L) + (12 + L)) * el  # both branch buffers
    act = 2 * L * (4 * D + 3 * geo.heads * geo.head_dim + 2 * geo.kv_heads * geo.head_dim + 3 * geo.mlp) * el
    state = 4 * 3 * size * size * 4  # float32 x, z and the two branch velocities
    return {"baseline": base, "loaded": loaded, "peak": peak.peak, "weights": weights, "kv": kv, "activations": act,
            "state": state}


def _tensors(root: object) -> list[torch.Tensor]:
    """Every tensor reachable from the tower's objects (each counted once)."""
    out, seen, todo = [], set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif type(obj).__module__.startswith("neopp"):
            todo.extend(vars(obj).values())
    return out


def memory_section(layers: int, size: int, prefix: int) -> str:
    rows = []
    geo = BenchGeometry(layers=layers)
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "bfloat16"):
            ckpt = write_checkpoint(geo, Path(tmp) / dtype, getattr(torch, dtype))
            code = (f"import json; from bench.scaling import memory_child; "
                    f"print(json.dumps(memory_child({str(ckpt)!r}, {layers}, '{dtype}', {size}, {prefix})))")
            res = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, cwd=REPO,
                                            text=True).stdout.strip().splitlines()[-1])
            used = res["peak"] - res["baseline"]
            budget = res["weights"] + res["kv"] + res["activations"] + res["state"]
            mib = 2 ** 20
            rows.append(f"| {dtype} | {res['weights'] / mib:.0f} ({(res['loaded'] - res['baseline']) / mib:.0f}) | "
                        f"{res['kv'] / mib:.1f} | {res['activations'] / mib:.1f} | {res['state'] / mib:.0f} | "
                        f"{used / mib:.0f} | "
                        f"{used / budget:.2f} |")
    return (f"Peak resident memory of one guided generation ({size}x{size}, prefix {prefix}, {layers} layers, "
            "checkpoint loaded from disk as in serving), above the process baseline (torch imported), against "
            "weights + both branches' KV buffers + one layer's activations (both branches, analytic) + the float32 "
            "denoising state (x, z and two velocities):\n\n"
            "| dtype | weights MiB (RSS growth at load) | KV MiB | one layer's activations MiB | state MiB | "
            "measured peak MiB | ratio |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows))


def report_body(args: argparse.Namespace) -> str:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # the plot lands next to the report
    geo = BenchGeometry(layers=args.layers)
    return (f"Geometry: {geo}; one branch (CFG off); median (min-max) of {args.steps} steps.\n\n"
            + scaling_section(geo, args.steps, out) + "\n\n## Memory\n\n" + memory_section(args.layers, 1024, 300))


def main(argv: list[str] | None = None) -> None:
    section_main(argv, __doc__, "scaling.md", "Step time vs image and prefix length; memory", report_body,
                 layers=4, steps=3)


if __name__ == "__main__":
    main()
