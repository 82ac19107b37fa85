"""How fast the demo trains, and what a faster step could buy: image tokens per second of
`make train-demo`'s dense step against cheaper variants, side by side in one run.

The demo model's shape attribute improves with images seen, so the training step's throughput
bounds what `make train-demo` can reach in its time. Each variant keeps its own weights,
optimizer and data; their steps alternate one by one, so a busy machine slows all alike. Every step is the
real one (`demo.training.train_step`: loss, clipped gradient, AdamW, EMA).

    python -m bench.demo_train_speed    # bench/demo_train_speed.md
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import section_main
from demo.model import PIXEL_CONV1, demo_config, demo_tokenizer, init_weights, towers
from demo.training import Batches, flow_matching_loss, optimizer, train_step, vocabulary
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.model.layers import row_tiles


@dataclass(frozen=True)
class Variant:
    name: str
    pixel_conv1: int = PIXEL_CONV1
    token_budget: int = 384
    fused: bool = False


VARIANTS = (
    Variant("make train-demo's dense step"),
    Variant("pixel head conv1 128 channels (conv2 reads 32)", pixel_conv1=128),
    Variant("pixel head conv1 64 channels (conv2 reads 16)", pixel_conv1=64),
    Variant("768 image tokens per batch", token_budget=768),
    Variant("fused AdamW", fused=True),
    Variant("all three: conv1 64, 768 tokens, fused AdamW", pixel_conv1=64, token_budget=768, fused=True),
)
WARMUP = 3


class Run:
    """One variant's weights, optimizer and data, kept between rounds."""

    def __init__(self, v: Variant, seed: int = 0) -> None:
        cfg, self.tokenizer = demo_config(), demo_tokenizer(vocabulary())
        self.config, self.variant = CheckpointConfig.from_dict(cfg), v
        self.params = {k: t.requires_grad_(True) for k, t in
                       init_weights(cfg, len(self.tokenizer.vocab), seed, v.pixel_conv1).items()}
        self.ema = {k: t.detach().clone() for k, t in self.params.items()}
        self.opt = optimizer(self.params, 6e-4, v.fused)
        self.language, self.tower = towers(self.config, self.params, self.tokenizer)
        self.batches = Batches(seed, v.token_budget)
        self.tokens = 0

    def loss(self) -> torch.Tensor:
        loss = flow_matching_loss(self.batches, self.config, self.language, self.tower, self.tokenizer)
        self.tokens += self.batches.last_tokens
        return loss

    def steps(self, n: int) -> tuple[float, int]:
        """(seconds, image tokens) of ``n`` steps."""
        before, began = self.tokens, time.perf_counter()
        for _ in range(n):
            train_step(self.params, self.ema, self.opt, self.loss, 6e-4, 0.999)
        return time.perf_counter() - began, self.tokens - before


def op_shares(run: Run, steps: int) -> list[tuple[str, float]]:
    """Share of the step's operator time (the profiler's self CPU time) per kind of operator; the
    Python between operators and the drawing of the images are not in it."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run.steps(steps)
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    groups = {"convolutions (patch embedding and pixel head), forward and backward":
              ("aten::convolution_backward", "aten::mkldnn_convolution"),
              "matrix products (linears)": ("aten::mm", "aten::addmm", "aten::bmm"),
              "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                            "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
              "the noise (normal_)": ("aten::normal_",)}
    times = {name: 0.0 for name in groups}
    for e in prof.key_averages():
        for name, ops in groups.items():
            if e.key in ops:
                times[name] += e.self_cpu_time_total
    shares = [(name, t / total) for name, t in times.items()]
    return shares + [("other operators (elementwise, copies, optimizer)", 1 - sum(s for _, s in shares))]


def body(args) -> str:
    torch.set_num_threads(args.threads)
    runs = [Run(v) for v in VARIANTS]
    # [variant][block] -> (seconds, tokens); one step of each variant in turn, so that a slow
    # moment of a shared machine falls on all of them alike
    blocks = [[[0.0, 0] for _ in range(args.blocks)] for _ in runs]
    with row_tiles(0):
        for run in runs:
            run.steps(WARMUP)
        for block in range(args.blocks):
            for _ in range(args.steps):
                for i, run in enumerate(runs):
                    seconds, tokens = run.steps(1)
                    blocks[i][block][0] += seconds
                    blocks[i][block][1] += tokens
        shares = op_shares(runs[0], args.steps)

    def rate(i: int, block: int | None = None) -> float:
        parts = blocks[i] if block is None else [blocks[i][block]]
        return sum(t for _, t in parts) / sum(s for s, _ in parts)

    lines = [f"{args.blocks} blocks of {args.steps} steps per variant, one step of each in turn; seed 0, "
             f"untrained weights (a step's cost does not depend on them), {args.threads} threads. Range: the "
             "ratio within each block.", "",
             "| variant | image tokens / s | vs make train-demo (range over blocks) |", "|---|---|---|"]
    for i, v in enumerate(VARIANTS):
        ratios = [rate(i, k) / rate(0, k) for k in range(args.blocks)]
        lines.append(f"| {v.name} | {rate(i):.0f} | {rate(i) / rate(0):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")
    lines += ["", "Where make train-demo's step spends its operator time (profiler self time; the Python between "
              "operators and the drawing of images are outside it):", "", "| operators | share |", "|---|---|"]
    lines += [f"| {name} | {share * 100:.0f} % |" for name, share in shares]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    section_main(argv, __doc__, "demo_train_speed.md", "Demo training throughput", body,
                 blocks=4, steps=20, threads=2)


if __name__ == "__main__":
    main()
