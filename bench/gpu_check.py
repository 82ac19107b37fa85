"""GPU check: every serving mode the node's GPUs allow, on SenseNova-U1 8B's generation geometry.

    python -m bench.gpu_check [--steps 50] [--size 1024] [--checkpoint DIR]
    python -m bench.gpu_check --device cpu --layers 2 --size 64 --steps 2   # smoke run, no GPU

1 GPU: dense bf16, FP8, 8-step LoRA-merged (CFG off), MoE (48 layers, 128 experts top-8, an
assumed geometry); 2 GPUs: + CFG-parallel; 4 GPUs: + CFG x2 + Ulysses x2. The towers are
random, drawn on the device (no file), unless `--checkpoint` names a real one. Per mode it
prints seconds per step and image, peak memory, and the step's achieved TFLOP/s next to the
card's plain bf16 matmul rate; the parallel modes are compared with the single-device dense
mode as a step-time ratio and by pixel agreement (bf16 tolerance). The 1-GPU modes are sized
to finish within 10 minutes on one H200; `--budget-s` skips modes that would start past it.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from bench.geometry import MOE
from bench.gpu_modes import (
    SPEED_PATHS,
    CheckSpec,
    ModeRun,
    mode_runs,
    pixel_agreement,
    release,
    run_local,
    run_ranks,
)
from bench.step_efficiency import flops, gemm_shapes

# Pixel agreement of a parallel mode with the single-device image, in 8-bit levels: bf16 GEMMs
# reassociate differently when the branches or tokens are split, and 50 steps compound it.
TOL_MEAN, TOL_WITHIN2 = 1.0, 0.95


def step_tflop(spec: CheckSpec, run: ModeRun, cfg_on: bool) -> float:
    """Analytic TFLOP of one step (both branches when guided; MoE counts its top-k experts)."""
    tower = spec.geometry(run.moe)
    geo = replace(tower, mlp=tower.active_mlp)
    tokens = (spec.size // 32) ** 2
    one = flops(gemm_shapes(geo, tokens, spec.prefix))
    return (one + flops(gemm_shapes(geo, tokens, 12)) if cfg_on else one) / 1e12


def matmul_tflops(device: torch.device, n: int = 8192, repeats: int = 20) -> float:
    """The device's plain square bf16 matmul rate (smaller on CPU)."""
    if device.type == "cpu":
        n, repeats = 1024, 3
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def report_line(run: ModeRun, out: dict, spec: CheckSpec) -> str:
    if "steps" not in out:
        return f"{run.name:<22} FAILED (below)"
    steps = sorted(out["steps"])
    median = steps[len(steps) // 2]
    cfg_on = run.mode.sampling_params.enable_cfg
    batched = out.get("batched") and cfg_on and run.mode.world_size == 1
    return (
        f"{run.name:<22} {len(steps):>3} steps  {median * 1e3:9.1f} ms/step  {out['total_s']:7.2f} s/image  "
        f"peak {out['peak'] / 2**30:6.2f} GiB  {step_tflop(spec, run, cfg_on) / median:7.3g} TFLOP/s  "
        f"(build {out['build_s']:.1f} s{', CFG batched' if batched else ''})"
    )


# Compiling the 8B layers costs tens of seconds per mode on a cold cache: the compiled path runs
# where its goals are (dense against the matmul rate, FP8 against dense).
COMPILED_MODES = ("dense bf16", "fp8")


def paths_of(run: ModeRun) -> tuple[str, ...]:
    return tuple(p for p in SPEED_PATHS if p != "compiled" or run.name in COMPILED_MODES)


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def path_lines(run: ModeRun, out: dict, spec: CheckSpec) -> tuple[list[str], bool]:
    """One line per speed path of a one-device mode, against eager; graphs must be eager's bytes."""
    paths = out.get("paths", {})
    if "eager" not in paths:
        return [], True
    if "error" in paths["eager"]:
        return [f"  eager    FAILED: {paths['eager']['error']}"], False
    eager = median(paths["eager"]["steps"])
    lines, ok = [], True
    for name, res in paths.items():
        if "error" in res:
            lines.append(f"  {name:<8} FAILED: {res['error']}")
            ok &= name == "compiled"  # an opt-in path may fail without failing the check
            continue
        step = median(res["steps"])
        line = f"  {name:<8} {step * 1e3:9.1f} ms/step  x{eager / step:5.2f} vs eager"
        if res.get("graphs"):
            captures, replays, enabled = res["graphs"]
            line += f"  ({captures} graphs captured, {replays} replays{'' if enabled else ', GRAPHS TURNED OFF'})"
            ok &= enabled
        elif name != "eager":
            line += "  (no graphs on this device)"
        if name == "compiled":
            line += f"  (first 2-step image, compiling: {res['warmup_s']:.1f} s)"
        if name == "graphs":
            agree = pixel_agreement(res["pixels"], paths["eager"]["pixels"])
            same = agree["max"] == 0
            ok &= same
            line += f"  pixels {'byte-equal to eager' if same else 'DIFFER from eager (max ' + str(agree['max']) + ')'}"
        lines.append(line)
    for size, by_path in out.get("small", {}).items():
        lines.append(f"  guided {size}x{size} step: " + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in by_path.items()))
    return lines, ok


def attention_lines(timings: dict) -> list[str]:
    """What the attention kernel measurement saw per shape, and what it chose."""
    lines = []
    for (q_shape, kv_heads, keys, dtype, _), times in sorted(timings.items(), key=str):
        best = min(times, key=times.get) if times else "-"
        lines.append(f"  q {q_shape} over {kv_heads} KV heads x <= {keys} keys ({str(dtype).removeprefix('torch.')}): "
                     + ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in times.items()) + f" -> {best}")
    return lines


def goal_lines(results: dict, spec: CheckSpec, runs: list[ModeRun], matmul: float) -> list[str]:
    """The step goals, each with its target and what this run measured on the default path and with
    compiled layers (a parameter away)."""
    by_name = {r.name: r for r in runs}

    def step_s(name: str, path: str) -> float | None:
        res = results.get(name, {}).get("paths", {}).get(path, {})
        return median(res["steps"]) if "steps" in res else None

    def tflops(name: str, path: str) -> float | None:
        step = step_s(name, path)
        run = by_name.get(name)
        return None if step is None else step_tflop(spec, run, run.mode.sampling_params.enable_cfg) / step

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    small = results.get("dense bf16", {}).get("small", {})
    goals = [
        ("dense bf16 step, share of the bf16 matmul rate", ">=", 0.70,
         lambda p: ratio(tflops("dense bf16", p), matmul)),
        ("FP8 speed over dense bf16", ">=", 1.40, lambda p: ratio(step_s("dense bf16", p), step_s("fp8", p))),
        ("MoE TFLOP/s over dense bf16's", ">=", 0.40, lambda p: ratio(tflops("MoE", p), tflops("dense bf16", p))),
        ("guided 256x256 step, ms", "<=", 8.0, lambda p: small[256][p] * 1e3 if p in small.get(256, {}) else None),
        ("guided 512x512 step, ms", "<=", 12.0, lambda p: small[512][p] * 1e3 if p in small.get(512, {}) else None),
    ]
    lines = [f"  {'goal':<48} {'target':<8} {'default':>16} {'compiled':>16}"]
    for what, op, target, measure in goals:
        cells = []
        for path in ("default", "compiled"):
            got = measure(path)
            met = got is not None and (got >= target if op == ">=" else got <= target)
            cells.append("-" if got is None else f"{got:.2f} {'met' if met else 'MISSED'}")
        lines.append(f"  {what:<48} {op} {target:<5} {cells[0]:>16} {cells[1]:>16}")
    return lines


def compare(name: str, out: dict, base: dict) -> tuple[str, bool]:
    agree = pixel_agreement(out["pixels"], base["pixels"])
    ratio = sorted(out["steps"])[len(out["steps"]) // 2] / sorted(base["steps"])[len(base["steps"]) // 2]
    ok = agree["mean"] <= TOL_MEAN and agree["within2"] >= TOL_WITHIN2
    return (
        f"{name} vs dense bf16 on one device: step time x{ratio:.2f}; pixels max |diff| {agree['max']}, "
        f"mean {agree['mean']:.3f}, {agree['within2'] * 100:.1f}% within 2 levels -> "
        f"{'PASS' if ok else 'FAIL'} (tolerance: mean <= {TOL_MEAN}, >= {TOL_WITHIN2 * 100:.0f}% within 2)"
    ), ok


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, CheckSpec]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="devices (ranks) to use; default: every visible GPU, 1 on CPU",
    )
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--shrink", type=int, default=1, help="divide widths and head counts (CPU smoke only)")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lora-steps", type=int, default=8)
    p.add_argument("--prefix", type=int, default=300)
    p.add_argument("--moe-layers", type=int, default=MOE.layers)
    p.add_argument("--moe-experts", type=int, default=MOE.experts)
    p.add_argument("--moe-steps", type=int, default=20, help="enough for the step rate; each path runs them")
    p.add_argument("--checkpoint", default=None, help="a real dense checkpoint instead of random weights")
    p.add_argument("--budget-s", type=float, default=540.0, help="skip modes that would start after this")
    p.add_argument("--small-sizes", default="256,512", help="sizes of the guided-step goals (dense bf16)")
    a = p.parse_args(argv)
    a.small_sizes = tuple(int(v) for v in a.small_sizes.split(",") if v)
    spec = CheckSpec(
        a.device,
        a.layers,
        a.shrink,
        a.size,
        a.steps,
        a.lora_steps,
        a.prefix,
        a.moe_layers,
        a.moe_experts,
        a.moe_steps,
        a.checkpoint,
    )
    return a, spec


def main(argv: list[str] | None = None) -> int:
    args, spec = parse(argv)
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA device (or --device cpu for the smoke run)")
    device = torch.device("cuda:0" if spec.device == "cuda" else "cpu")
    devices = args.devices or (torch.cuda.device_count() if spec.device == "cuda" else 1)
    name = torch.cuda.get_device_name(0) if spec.device == "cuda" else "CPU"
    runs = mode_runs(spec, devices)
    if spec.checkpoint:
        runs = [r for r in runs if not r.moe]  # a dense checkpoint has no experts
    print(f"device: {devices} x {name}; torch {torch.__version__}; modes: {', '.join(r.name for r in runs)}")
    print(
        f"geometry: {spec.layers} layers x {spec.geometry(False).hidden} (shrink "
        f"{spec.shrink}); image {spec.size}x{spec.size}, {spec.steps} steps (LoRA {spec.lora_steps}, MoE "
        f"{spec.moe_steps}), prefix {spec.prefix}; time budget {args.budget_s:.0f} s for starting modes "
        "(the 1-GPU modes are sized for < 10 min on one H200)"
    )
    matmul = matmul_tflops(device)
    print(f"bf16 matmul: {matmul:.3g} TFLOP/s", flush=True)
    start, results, ok = time.perf_counter(), {}, True
    for run in runs:
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            print(f"{run.name:<22} skipped: {elapsed:.0f} s elapsed, past the {args.budget_s:.0f} s budget")
            continue
        small = args.small_sizes if run.name == "dense bf16" else ()
        results[run.name] = (
            run_ranks(spec, run, torch.bfloat16)
            if run.mode.world_size > 1
            else run_local(spec, run, device, torch.bfloat16, small, paths_of(run))
        )
        print(
            report_line(run, results[run.name], spec) + f"  [t={time.perf_counter() - start:.0f} s]",
            flush=True,
        )
        lines, same = path_lines(run, results[run.name], spec)
        ok &= same
        print("\n".join(lines), flush=True)
        release(device)
    base = results.get("dense bf16")
    for run in runs:
        if run.mode.world_size > 1 and run.name in results and base is not None:
            line, passed = compare(run.name, results[run.name], base)
            ok &= passed
            print(line)
    attention = results.get("dense bf16", {}).get("attention", {})
    if attention:
        print("attention kernels measured on the default path (dense bf16):")
        print("\n".join(attention_lines(attention)))
    print("goals (default: graphs and the measured attention kernel; compiled: the same with compile_layers on):")
    print("\n".join(goal_lines(results, spec, runs, matmul)))
    print(
        f"total {time.perf_counter() - start:.0f} s; "
        f"{'all comparisons passed' if ok else 'A COMPARISON FAILED'} (parallel modes' pixels, graphs' bytes)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
