"""Layer offload on a GPU: step time and peak memory of offload none / low / balanced, one tower
geometry (the 8B generation tower by default, random weights drawn on the device), side by side
in one run, and each offloaded image's bytes against the resident one's.

    python -m bench.offload_check                      # CUDA, 8B geometry, 1024x1024, 8 guided steps
    python -m bench.offload_check --device cpu --shrink 16 --layers 3 --size 64 --steps 2   # smoke

On the CPU the offload runs as its stand-in (the CPU is host and "device" at once), so the smoke
run checks the code path and the bytes, not the memory or the copies' cost.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import write_report
from bench.geometry import random_tower_tensors
from bench.gpu_modes import CheckSpec, ModeRun, peak_bytes, release, request, sync
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.model.layer_offload import LayerOffload
from neopp.model.transformer import NeoPPTransformer
from neopp.modes import ModeSpec
from neopp.sampling.pipeline import NeoPPPipeline

POLICIES = ("none", "low", "balanced")


def build(spec: CheckSpec, policy: str, device: torch.device, dtype: torch.dtype) -> NeoPPPipeline:
    geo = spec.geometry(moe=False)
    cfg = CheckpointConfig.from_dict(geo.config())
    offload = None if policy == "none" else LayerOffload(policy, device)
    tensors = random_tower_tensors(cfg, device, dtype, geo.mlp, geo.head_width)
    tower = NeoPPTransformer.from_tensors(cfg, tensors, device, dtype, offload=offload)
    del tensors
    return NeoPPPipeline(cfg, tower, ModeSpec(name=f"offload_{policy}"), device, dtype)


def measure(spec: CheckSpec, policy: str, device: torch.device, dtype: torch.dtype) -> dict:
    """Build, a 2-step warm-up, then the timed image: step seconds, memory at rest and at peak."""
    release(device)
    began = time.perf_counter()
    pipe = build(spec, policy, device, dtype)
    sync(device)
    build_s = time.perf_counter() - began
    release(device)
    resting = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    run = ModeRun(policy, pipe.mode)
    pipe.generate(request(pipe, spec, run, steps=2))
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps: list[float] = []
    pixels = pipe.generate(request(pipe, spec, run), on_step=lambda k, s: steps.append(s))
    sync(device)
    offload = pipe.transformer.offload
    out = {"build_s": build_s, "step_s": float(np.median(steps)), "resting": resting, "peak": peak_bytes(device),
           "pixels": pixels, "host": offload.host_bytes if offload else 0,
           "layer_bytes": offload.layers[0].nbytes if offload else 0}
    del pipe
    release(device)
    return out


def report(spec: CheckSpec, device: torch.device, results: dict[str, dict]) -> tuple[str, str]:
    """The report's title and body."""
    gib = 2 ** 30
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (stand-in: no copies)"
    base = results["none"]
    title = (f"Layer offload: {spec.layers} layers of the 8B geometry (widths / {spec.shrink}), "
             f"{spec.size}x{spec.size}, {spec.steps} guided steps, {name}")
    lines = ["| offload | step (s) | against none | memory at rest (GiB) | peak (GiB) | pinned host (GiB) | "
             "same bytes as none |", "|---|---|---|---|---|---|---|"]
    for policy in POLICIES:
        r = results.get(policy)
        if r is None or "error" in r:
            lines.append(f"| {policy} | failed: {r['error'] if r else 'not run'} | | | | | |")
            continue
        same = bool(np.array_equal(r["pixels"], base["pixels"]))
        lines.append(f"| {policy} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f}x | "
                     f"{r['resting'] / gib:.2f} | {r['peak'] / gib:.2f} | {r['host'] / gib:.2f} | {same} |")
    layer = next((r["layer_bytes"] for r in results.values() if r.get("layer_bytes")), 0)
    lines += ["", f"One layer's weights: {layer / gib:.3f} GiB. On the CPU the stand-in's memory columns are "
              "the process's, not a device's."]
    return title, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--shrink", type=int, default=1)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prefix", type=int, default=300)
    p.add_argument("--out", default="bench")
    p.add_argument("--report", default="offload_gpu.md")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 1
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = CheckSpec(device=args.device, layers=args.layers, shrink=args.shrink, size=args.size, steps=args.steps,
                     prefix=args.prefix)
    results: dict[str, dict] = {}
    for policy in POLICIES:
        try:
            results[policy] = measure(spec, policy, device, dtype)
        except Exception as exc:  # noqa: BLE001 - one failed policy is reported; the others still run
            results[policy] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    if "error" in results["none"]:
        print(f"the resident tower failed: {results['none']['error']}")
        return 1
    write_report(Path(args.out) / args.report, *report(spec, device, results))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
