"""Denoising-step efficiency: achieved GFLOP/s of one step against plain matmuls of its shapes.

    python -m bench.step_efficiency [--out bench] [--layers 8] [--size 512] [--prefix 300]

The step's FLOPs are counted analytically (every GEMM, conv-as-GEMM and attention product);
the matmul anchor times `torch.matmul` on exactly those GEMM shapes in the same run, so the
ratio says how close the step is to this machine's limit for its work.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import section_main, stats, timed
from bench.geometry import BenchGeometry
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.model.transformer import NeoPPTransformer
from neopp.modes import ModeSpec, SamplingParams
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing.tiny_checkpoint import random_kv, tiny_tensors


def build_pipeline(geo: BenchGeometry, dtype: torch.dtype, device: str = "cpu") -> NeoPPPipeline:
    """A random tower of this geometry built in memory (no checkpoint file needed)."""
    raw = geo.config()
    cfg = CheckpointConfig.from_dict(raw)
    tensors = tiny_tensors(raw, seed=1, mlp_width=geo.mlp, head_width=geo.head_width)
    dev = torch.device(device)
    return NeoPPPipeline(cfg, NeoPPTransformer.from_tensors(cfg, tensors, dev, dtype), ModeSpec(), dev, dtype)


def gemm_shapes(geo: BenchGeometry, tokens: int, prefix: int) -> list[tuple[int, int, int, int, int]]:
    """(count, batch, M, K, N) of every product in one branch's step; attention is batched per head."""
    d, q, kv = geo.hidden, geo.heads * geo.head_dim, geo.kv_heads * geo.head_dim
    patches = tokens * 4
    per_layer = [(1, 1, tokens, d, q), (2, 1, tokens, d, kv), (1, 1, tokens, q, d), (2, 1, tokens, d, geo.mlp),
                 (1, 1, tokens, geo.mlp, d),
                 (1, geo.heads, tokens, geo.head_dim, prefix + tokens),
                 (1, geo.heads, tokens, prefix + tokens, geo.head_dim)]
    shapes = [(c * geo.layers, b, m, k, n) for c, b, m, k, n in per_layer]
    shapes += [(1, 1, patches, 3 * 256, geo.vision), (1, 1, tokens, geo.vision * 4, d),
               (1, 1, tokens, d, geo.head_width), (1, 1, tokens, geo.head_width, 32 * 32 * 3)]
    return shapes


def flops(shapes: list[tuple[int, int, int, int, int]]) -> float:
    return float(sum(2 * c * b * m * k * n for c, b, m, k, n in shapes))


def matmul_seconds(shapes, dtype: torch.dtype, repeats: int) -> float:
    """Median time of plain matmuls over the same shapes (attention products as one batched
    matmul per layer), each in the faster of the two operand layouts (`x @ W^T` as the tower
    stores weights, or `x @ B` with B row-major): the best a plain matmul does here."""
    total = 0.0
    for count, batch, m, k, n in shapes:
        a = torch.randn(batch, m, k, dtype=dtype)
        w = torch.randn(batch, n, k, dtype=dtype)
        b = w.mT.contiguous()
        best = min(stats(timed(lambda a=a, w=w: torch.matmul(a, w.mT), repeats, warmup=3))[0],
                   stats(timed(lambda a=a, b=b: torch.matmul(a, b), repeats, warmup=3))[0])
        total += count * best
    return total


def peak_matmul_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """The machine's square-matmul rate: the ceiling no step of this width can pass."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / stats(timed(lambda: torch.matmul(a, b), repeats, warmup=2))[0] / 1e9


def step_seconds(pipe: NeoPPPipeline, size: int, prefix: int, repeats: int) -> list[float]:
    raw_kv = random_kv({"llm_config": {"num_hidden_layers": pipe.config.num_layers,
                                       "num_key_value_heads": pipe.config.num_kv_heads,
                                       "head_dim": pipe.config.head_dim}}, prefix, 0, torch.float32)
    req = GenerationRequest(cond_kv=raw_kv, index_offset_cond=prefix, height=size, width=size,
                            noise=NoiseStream(0).draw(size, size),
                            sampling_params=SamplingParams(infer_steps=repeats + 1, enable_cfg=False))
    per_step: list[float] = []
    pipe.sample(req, on_step=lambda k, s: per_step.append(s))
    return per_step[1:]  # the first step warms caches up


def run(args: argparse.Namespace) -> str:
    geo, size, prefix, repeats = BenchGeometry(layers=args.layers), args.size, args.prefix, args.repeats
    tokens = (size // 32) ** 2
    shapes = gemm_shapes(geo, tokens, prefix)
    work = flops(shapes)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        pipe = build_pipeline(geo, dtype)
        med, lo, hi = stats(step_seconds(pipe, size, prefix, repeats))
        mm = matmul_seconds(shapes, dtype, repeats)
        peak = peak_matmul_gflops(dtype)
        rows.append(f"| {str(dtype).split('.')[-1]} | {med * 1e3:.1f} ({lo * 1e3:.1f}-{hi * 1e3:.1f}) | "
                    f"{work / med / 1e9:.0f} | {work / mm / 1e9:.0f} | {mm / med:.2f} | {peak:.0f} | "
                    f"{work / med / 1e9 / peak:.2f} |")
        del pipe
    return (f"Geometry: {geo}, image {size}x{size} ({tokens} tokens), prefix {prefix} tokens, one branch "
            f"(CFG off), {work / 1e9:.1f} GFLOP per step (analytic). Step time: median (min-max) of "
            f"{repeats} steps. The anchor runs `torch.matmul` on exactly the step's GEMM shapes (weights in "
            "the tower's [out, in] layout, attention as one batched matmul per layer); the last two columns "
            "compare with a 2048^3 square matmul, the machine's ceiling.\n\n| dtype | step ms | step GFLOP/s | "
            "matmul GFLOP/s (same shapes) | ratio | square matmul GFLOP/s | ratio |\n"
            "|---|---|---|---|---|---|---|\n" + "\n".join(rows))


def main(argv: list[str] | None = None) -> None:
    section_main(argv, __doc__, "step_efficiency.md", "Denoising-step efficiency", run,
                 layers=8, size=512, prefix=300, repeats=5)


if __name__ == "__main__":
    main()
