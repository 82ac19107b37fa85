"""Modes benchmark: FP8 weight memory vs bf16, step time of every mode, MoE dispatch vs naive.

    python -m bench.modes_bench [--out bench] [--size 512] [--steps 3] [--device cpu]

Writes `<out>/modes.md` (with the exact command) and prints it. Weights are random, in the
real key layout, at a stated mid-size geometry, so the figures are about the runner, not
about image quality. Everything is measured in one run, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common import REPO
from neopp.engines.factory import build_engine
from neopp.engines.spec import EngineSpec
from neopp.model.layers import Linear, MoE, SwiGLU
from neopp.model.quant import weight_bytes
from neopp.modes import load_mode
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.plan import step_plan
from neopp.sampling.rng import NoiseStream
from testing.tiny_checkpoint import TINY_VISION, random_kv, tiny_tensors
from testing.tiny_lora import write_tiny_loras

MID_LLM = {"num_hidden_layers": 4, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4,
           "head_dim": 64, "rope_theta": 1_000_000.0, "rope_theta_hw": 10_000.0}
MID_MLP, MID_HEAD, MID_EXPERTS, MID_TOP_K, MID_EXPERT_MLP = 2816, 1024, 8, 2, 704
PREFIX_TOKENS = 256
MODES = [  # (label, mode file, checkpoint)
    ("neopp_dense (fp32)", "neopp_dense", "dense"),
    ("neopp_dense (bf16)", "neopp_dense", "dense"),
    ("neopp_dense_fp8 (fp32)", "neopp_dense_fp8", "dense"),
    ("neopp_dense_fp8 (bf16)", "neopp_dense_fp8", "dense"),
    ("neopp_dense_8steps", "neopp_dense_8steps", "dense"),
    ("neopp_moe", "neopp_moe", "moe"),
    ("neopp_moe_cfg", "neopp_moe_parallel_cfg", "moe"),
]


def mid_config(moe: bool) -> dict:
    llm = dict(MID_LLM)
    if moe:
        llm.update(gen_num_experts=MID_EXPERTS, num_experts_per_tok=MID_TOP_K, norm_topk_prob=True)
    return {"model_type": "neo_chat", "llm_config": llm, "vision_config": {**TINY_VISION, "hidden_size": 256},
            "patch_size": 16}


def write_mid_checkpoints(root: Path) -> dict[str, Path]:
    """bf16 dense and MoE checkpoints plus a LoRA for the dense one."""
    out = {}
    for name, moe in (("dense", False), ("moe", True)):
        cfg = mid_config(moe)
        tensors = tiny_tensors(cfg, seed=1, mlp_width=MID_EXPERT_MLP if moe else MID_MLP, head_width=MID_HEAD)
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text(json.dumps(cfg))
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
                  str(root / name / "model.safetensors"))
        if not moe:
            out["lora"] = write_tiny_loras(root / "lora", tensors)["neopp_8steps_lora"]
        out[name] = root / name
    return out


def request(cfg: dict, size: int, steps: int, sampling) -> GenerationRequest:
    return GenerationRequest(cond_kv=random_kv(cfg, PREFIX_TOKENS, 1), index_offset_cond=PREFIX_TOKENS,
                             height=size, width=size, noise=NoiseStream(0).draw(size, size),
                             sampling_params=sampling.replace(infer_steps=steps + 1),
                             uncond_kv=random_kv(cfg, PREFIX_TOKENS // 4, 2), index_offset_uncond=PREFIX_TOKENS // 4)


def step_times(gen, req: GenerationRequest) -> list[float]:
    """Seconds of each denoising step after the first (warm-up) one."""
    seconds: list[float] = []
    gen.generate(req, on_step=lambda _k, s: seconds.append(s))
    return seconds[1:]


def bench_modes(ckpts: dict[str, Path], size: int, steps: int, device: str, threads: int) -> list[dict]:
    rows = []
    for label, mode_name, ckpt in MODES:
        mode = load_mode(REPO / "configs" / "neopp" / f"{mode_name}.json", lora_dir=ckpts["lora"].parent)
        dtype = torch.bfloat16 if "bf16" in label else (torch.float32 if device == "cpu" else None)
        per_rank = max(1, threads // mode.world_size)
        start = time.perf_counter()
        gen = build_engine(EngineSpec.local(ckpts[ckpt], mode, device, dtype=dtype, threads=per_rank))
        load_s = time.perf_counter() - start
        try:
            req = request(mid_config(ckpt == "moe"), size, steps, mode.sampling_params)
            times = step_times(gen, req)
            guided = sum(step_plan(req).guided_steps[1:])
        finally:
            if hasattr(gen, "close"):
                gen.close()
        rows.append({"mode": label, "ranks": mode.world_size, "threads/rank": per_rank,
                     "branches/step": 2 if guided else 1, "load s": load_s,
                     "step s (median)": statistics.median(times), "step s (min)": min(times)})
        print(f"  {label}: {rows[-1]['step s (median)']:.3f} s/step", flush=True)
        del gen
    return rows


def weight_memory(ckpt: Path, device: str) -> dict:
    """Bytes held by the decoder-layer linears and the whole tower, bf16 load vs FP8 load."""
    out = {}
    for label, mode_name, dtype in (("bf16", "neopp_dense", torch.bfloat16),
                                    ("fp8", "neopp_dense_fp8", torch.bfloat16)):
        pipe = NeoPPPipeline.from_pretrained(ckpt, load_mode(REPO / "configs" / "neopp" / f"{mode_name}.json"),
                                             device, dtype)
        tower = pipe.transformer
        layer_linears = [lin for layer in tower.layers for lin in (layer.q_proj, layer.k_proj, layer.v_proj,
                                                                    layer.o_proj, *layer.mlp.linears())]
        out[label] = {"layer linears": weight_bytes(layer_linears), "all linears + heads": weight_bytes(
            tower.linears() + [tower.head.fc1, tower.head.fc2])}
        del pipe, tower, layer_linears
    return out


_RSS_PROBE = """
import ctypes, gc, sys, torch
from neopp.modes import load_mode
from neopp.sampling.pipeline import NeoPPPipeline
def kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
before = kb("VmRSS:")
pipe = NeoPPPipeline.from_pretrained(sys.argv[1], load_mode(sys.argv[2]), sys.argv[3], torch.bfloat16)
for lin in pipe.transformer.linears():  # touch every page (safetensors maps bf16 weights lazily)
    lin.weight.view(torch.uint8).sum()
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand back freed load-time temporaries
print(kb("VmRSS:") - before, kb("VmHWM:") - before)
"""


def resident_memory(ckpt: Path, device: str) -> dict[str, tuple[int, int]]:
    """(resident, peak) KiB added by loading, each in a fresh process (Linux /proc only)."""
    if not Path("/proc/self/status").exists() or device != "cpu":
        return {}
    out = {}
    for label, mode_name in (("bf16", "neopp_dense"), ("fp8", "neopp_dense_fp8")):
        mode_file = REPO / "configs" / "neopp" / f"{mode_name}.json"
        res = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(ckpt), str(mode_file), device],
                             capture_output=True, text=True, check=True)
        rss, peak = res.stdout.split()[-2:]
        out[label] = (int(rss), int(peak))
    return out


def naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert over every token, weighted by a dense [N, E] routing matrix (zeros off top-k)."""
    weights, ids = moe.route(x)
    dense = torch.zeros(x.shape[0], len(moe.experts), dtype=torch.float32).scatter_(1, ids, weights)
    out = torch.zeros_like(x)
    for e, expert in enumerate(moe.experts):
        out += expert(x) * dense[:, e:e + 1].to(x.dtype)
    return out


def timed_pair(a: Callable[[], torch.Tensor], b: Callable[[], torch.Tensor], repeats: int = 7) -> tuple[float, float]:
    """Median seconds of a and b, run alternately so load on a shared box hits both alike."""
    a(), b()
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((a, samples[0]), (b, samples[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(samples[0]), statistics.median(samples[1])


@torch.inference_mode()
def bench_moe_dispatch(tokens: int, device: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    D, F, E = MID_LLM["hidden_size"], MID_EXPERT_MLP, MID_EXPERTS

    def lin(o: int, i: int) -> Linear:
        return Linear((torch.randn(o, i, generator=gen) / i ** 0.5).to(device))

    moe = MoE(lin(E, D), [SwiGLU(lin(F, D), lin(F, D), lin(D, F)) for _ in range(E)], MID_TOP_K, True)
    x = torch.randn(tokens, D, generator=gen).to(device)
    grouped, naive = moe(x), naive_moe(moe, x)
    err = ((grouped - naive).norm() / naive.norm()).item()
    grouped_s, naive_s = timed_pair(lambda: moe(x), lambda: naive_moe(moe, x))
    return {"tokens": tokens, "experts": E, "top_k": MID_TOP_K, "grouped s": grouped_s, "naive s": naive_s,
            "relative difference": err}


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def report(args: argparse.Namespace, command: str, mem: dict, rss: dict, modes: list[dict], moe: dict) -> str:
    mb = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    ratio = mem["fp8"]["layer linears"] / mem["bf16"]["layer linears"]
    lines = [
        "# NeoPP modes benchmark", "", f"Command: `{command}`", "",
        f"Machine: {platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, device {args.device}, "
        f"{args.threads} threads; {time.strftime('%Y-%m-%d %H:%M')}; load average at the start "
        f"{args.load:.1f} (a shared box: other jobs ran alongside, so treat step times as +-20%).",
        f"Mid-size tower (random weights, real key layout, stored bf16): {MID_LLM['num_hidden_layers']} layers, "
        f"D {MID_LLM['hidden_size']}, {MID_LLM['num_attention_heads']} heads / {MID_LLM['num_key_value_heads']} KV "
        f"heads x {MID_LLM['head_dim']}, dense MLP {MID_MLP}, MoE {MID_EXPERTS} experts top-{MID_TOP_K} of width "
        f"{MID_EXPERT_MLP}; image {args.size}x{args.size} ({(args.size // 32) ** 2} tokens), "
        f"cond prefix {PREFIX_TOKENS} tokens.", "",
        "## Weight memory, FP8 vs bf16", "",
        "| | bf16 load | FP8 load | ratio |", "|---|---|---|---|",
    ]
    for key in ("layer linears", "all linears + heads"):
        b, f = mem["bf16"][key], mem["fp8"][key]
        lines.append(f"| {key} (tensor bytes) | {mb(b)} | {mb(f)} | {f / b:.3f} |")
    for label, idx in (("process RSS added by the load", 0), ("peak RSS added during the load", 1)):
        if rss:
            b, f = rss["bf16"][idx] * 1024, rss["fp8"][idx] * 1024
            lines.append(f"| {label} | {mb(b)} | {mb(f)} | {f / b:.3f} |")
    lines += ["", f"Target <= 0.55 for the layer linears: {'met' if ratio <= 0.55 else 'NOT met'} ({ratio:.3f}; "
              "1 byte per weight + a 4-byte scale per output row, vs 2 bytes).", "",
              f"## Step time per mode ({args.steps} timed steps after one warm-up step; median)", "",
              table(modes), "",
              "(fp32)/(bf16): the compute dtype (on CPU the runner's default is fp32). Without an FP8 matmul "
              "(CPUs, GPUs before sm90) an FP8 layer converts its own weight to the compute dtype for the call "
              "and scales the output columns, so it trades time for memory; on sm90+ GPUs it runs "
              "torch._scaled_mm instead. The 8-step LoRA mode runs one branch per step (CFG off); the CFG modes "
              "on one device batch both branches; neopp_moe_cfg splits the two branches over two rank "
              "processes (so it uses twice the cores of the 1-rank rows).", "",
              "## MoE expert dispatch: grouped (one matmul per expert over its tokens) vs naive loop", "",
              table([moe]), "",
              f"Speed-up of grouped dispatch: {moe['naive s'] / moe['grouped s']:.2f}x (naive runs every expert "
              f"over all {moe['tokens']} tokens; the outputs agree to {moe['relative difference']:.1e}).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench", help="folder for modes.md")
    parser.add_argument("--size", type=int, default=512, help="image side in pixels (multiple of 32)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    parser.add_argument("--moe-tokens", type=int, default=1024, help="tokens of the dispatch benchmark")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (split over the ranks of a multi-rank mode); 1 keeps a shared box stable")
    args = parser.parse_args(argv)
    command = "python -m bench.modes_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    torch.set_num_threads(args.threads)
    args.load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    with tempfile.TemporaryDirectory(prefix="neopp_modes_bench_") as tmp:
        print("writing mid-size checkpoints ...", flush=True)
        ckpts = write_mid_checkpoints(Path(tmp))
        print("weight memory ...", flush=True)
        mem = weight_memory(ckpts["dense"], args.device)
        rss = resident_memory(ckpts["dense"], args.device)
        print("MoE dispatch ...", flush=True)
        moe = bench_moe_dispatch(args.moe_tokens, args.device)
        print("step time per mode ...", flush=True)
        modes = bench_modes(ckpts, args.size, args.steps, args.device, args.threads)
    text = report(args, command.strip(), mem, rss, modes, moe)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "modes.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
