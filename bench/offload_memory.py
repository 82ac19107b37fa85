"""GPU memory of one generation model, computed from the tower geometry: U1-8B, A3B and U1.5 x
bf16 / FP8 / GGUF Q8_0 / Q4_K x offload none / low / balanced, at 1024x1024 and 2048x2048, and the
smallest card class (24, 48, 80, 141 GB) each fits.

    python -m bench.offload_memory --out bench

The parameters are counted from the very keys and shapes the loader checks
(``bench.geometry.tower_shapes``). The assumptions are printed with the table; the measured
figures of offload on a GPU come from ``bench.offload_check`` (``make gpu-check``).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from bench.common import write_report
from bench.geometry import EIGHT_B, BenchGeometry, tower_shapes
from neopp.model.checkpoint import LM
from neopp.model.checkpoint_config import CheckpointConfig

GB = 1e9
CARDS = (24, 48, 80, 141)
PREFIX = 1000  # prefix tokens per branch
BATCH_CFG_MAX_TOKENS = 4096  # both branches in one batch up to this many rows (the pipeline's bound)
CONTEXT_GB = 1.0  # CUDA context and allocator slack per process
RESIDENT = {"none": None, "low": 1, "balanced": 3}
# Bytes per parameter of a decoder-layer linear (the router and everything else stay bf16);
# FP8 adds a float32 scale per output row.
HELD = {"bf16": 2.0, "FP8": 1.0, "GGUF Q8_0": 34 / 32, "GGUF Q4_K": 144 / 256}
# A linear dequantized per call: its float32 weight, then the run dtype's copy (GGUF); FP8 on a
# card without scaled FP8 products (before compute capability 9.0) converts to bf16.
SCRATCH = {"bf16": 0.0, "FP8": 2.0, "GGUF Q8_0": 6.0, "GGUF Q4_K": 6.0}

A3B = replace(EIGHT_B, layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, mlp=768, experts=32, top_k=8,
              head_width=2048)
TOWERS = {"U1-8B": EIGHT_B, "A3B": A3B, "U1.5-8B": EIGHT_B}


@dataclass(frozen=True)
class Counts:
    """A tower's parameters: per layer, the linears a format quantizes (and their output rows), the
    rest of the layer (router, norms), and what lies outside the layers."""

    layers: int
    quantized: int
    rows: int
    layer_rest: int
    outside: int
    largest: int  # the largest layer linear's parameters

    @staticmethod
    def of(geo: BenchGeometry) -> Counts:
        cfg = CheckpointConfig.from_dict(geo.config())
        shapes = tower_shapes(cfg, geo.mlp, geo.head_width)
        first = f"{LM}layers.0."
        quantized = rows = rest = outside = largest = 0
        for key, shape in shapes.items():
            n = 1
            for side in shape:
                n *= side
            if not key.startswith(first):
                outside += 0 if key.startswith(f"{LM}layers.") else n
            elif len(shape) == 2 and not key.endswith("mlp_mot_gen.gate.weight"):
                quantized, rows, largest = quantized + n, rows + shape[0], max(largest, n)
            else:
                rest += n
        return Counts(cfg.num_layers, quantized, rows, rest, outside, largest)

    def layer_bytes(self, held: str) -> float:
        scales = 4 * self.rows if held == "FP8" else 0
        return self.quantized * HELD[held] + scales + 2 * self.layer_rest


def activations(geo: BenchGeometry, tokens: int) -> float:
    """One layer's working set for a guided step (both branches batched while they fit)."""
    rows = 2 * tokens if 2 * tokens <= BATCH_CFG_MAX_TOKENS else tokens
    kv = geo.kv_heads * geo.head_dim
    mlp = geo.mlp * (geo.top_k if geo.experts else 1)
    gathered = geo.top_k * geo.hidden if geo.experts else 0
    return rows * (4 * geo.hidden + 2 * kv + 3 * mlp + gathered) * 2


def kv_contexts(geo: BenchGeometry, tokens: int) -> float:
    """Both branches' keys and values over prefix and image tokens, every layer (never offloaded)."""
    return 2 * geo.layers * 2 * (PREFIX + tokens) * geo.kv_heads * geo.head_dim * 2


def need(geo: BenchGeometry, counts: Counts, held: str, offload: str, side: int) -> float:
    tokens = (side // 32) ** 2
    resident = counts.layers if RESIDENT[offload] is None else min(RESIDENT[offload], counts.layers)
    weights = 2 * counts.outside + resident * counts.layer_bytes(held)
    scratch = counts.largest * SCRATCH[held]
    return (weights + kv_contexts(geo, tokens) + activations(geo, tokens) + scratch) / GB + CONTEXT_GB


@dataclass(frozen=True)
class Encoder:
    """An understanding tower (the prompt encoder): its layers' linears and routers, its token
    embedding and output head, and what one forward of 4,096 tokens holds."""

    layers: int
    hidden: int
    q_width: int
    kv_width: int
    mlp: int
    experts: int = 0
    top_k: int = 0
    vocabulary: int = 151_936
    tokens: int = 4096

    def linears(self) -> int:
        mlp = 3 * self.hidden * self.mlp * max(1, self.experts)
        return 2 * self.hidden * self.q_width + 2 * self.hidden * self.kv_width + mlp

    def need(self, held: str, offload: str) -> float:
        held = "bf16" if held == "FP8" else held  # the encoder has no FP8 mode: bf16 on a GPU
        layer = self.linears() * HELD[held] + 2 * self.experts * self.hidden
        resident = self.layers if RESIDENT[offload] is None else RESIDENT[offload]
        outside = 2 * 2 * self.vocabulary * self.hidden
        kv = self.layers * 2 * self.tokens * self.kv_width * 2
        active = self.mlp * (self.top_k if self.experts else 1)
        work = self.tokens * (4 * self.hidden + 2 * self.kv_width + 3 * active) * 2
        return (outside + resident * layer + kv + work) / GB + CONTEXT_GB


ENCODERS = {"U1-8B": Encoder(36, 4096, 4096, 1024, 12288), "U1.5-8B": Encoder(36, 4096, 4096, 1024, 12288),
            "A3B": Encoder(48, 2048, 4096, 512, 768, experts=128, top_k=8)}


def card(gb: float) -> str:
    return next((f"{c} GB" for c in CARDS if gb <= c), "none of them")


def cases() -> Iterator[tuple[str, BenchGeometry, Counts, str, str]]:
    """(tower, geometry, counts, weight format, offload) for every row of the tables."""
    for name, geo in TOWERS.items():
        counts = Counts.of(geo)
        for held in HELD:
            for offload in RESIDENT:
                yield name, geo, counts, held, offload


def table() -> str:
    lines = ["| tower | weights | offload | 1024x1024 | 2048x2048 | smallest card (2048x2048) | pinned host memory |",
             "|---|---|---|---|---|---|---|"]
    for name, geo, counts, held, offload in cases():
        small, large = need(geo, counts, held, offload, 1024), need(geo, counts, held, offload, 2048)
        host = 0.0 if offload == "none" else counts.layers * counts.layer_bytes(held) / GB
        lines.append(f"| {name} | {held} | {offload} | {small:.1f} GB | {large:.1f} GB | {card(large)} | "
                     f"{host:.1f} GB |")
    return "\n".join(lines)


def together() -> str:
    """A generation model and its prompt encoder on one card, both with the same format and offload."""
    lines = ["| tower | weights | offload | generation model | prompt encoder | together | smallest card |",
             "|---|---|---|---|---|---|---|"]
    for name, geo, counts, held, offload in cases():
        gen, enc = need(geo, counts, held, offload, 2048), ENCODERS[name].need(held, offload)
        lines.append(f"| {name} | {held} | {offload} | {gen:.1f} GB | {enc:.1f} GB | {gen + enc:.1f} GB | "
                     f"{card(gen + enc)} |")
    return "\n".join(lines)


def assumptions() -> str:
    eight, a3b = Counts.of(EIGHT_B), Counts.of(A3B)
    return "\n".join([
        "Computed, not measured (no GPU was at hand). One generation model on one GPU, CFG on, "
        f"a {PREFIX}-token prefix per branch; GB = 10^9 bytes.",
        "",
        f"* U1-8B: {eight.layers} layers of {eight.layer_bytes('bf16') / GB:.2f} GB in bf16, "
        f"{2 * eight.outside / GB:.2f} GB outside the layers. A3B's generation tower: {a3b.layers} layers of "
        f"hidden 2048, 32 experts of width 768 (top 8), {a3b.layer_bytes('bf16') / GB:.2f} GB a layer in bf16. "
        "U1.5-8B is counted with U1-8B's layer geometry (its own config.json was not at hand); its "
        "ConvDecoder head is small either way.",
        "* Weights: a layer linear takes 2 bytes a parameter in bf16, 1 in FP8 (plus a float32 scale per "
        "output row), 34/32 in Q8_0, 144/256 in Q4_K; routers, norms and everything outside the layers "
        "stay bf16.",
        "* Offload keeps every layer on the device (none), one (low) or three (balanced); the keys and "
        "values of both branches stay on the device for every layer: "
        f"{kv_contexts(EIGHT_B, 1024) / GB:.2f} GB (U1-8B) at 1024x1024, "
        f"{kv_contexts(EIGHT_B, 4096) / GB:.2f} GB at 2048x2048.",
        "* Working set: one layer's activations (both branches in one batch up to 4,096 rows), plus the "
        "largest linear dequantized per call for GGUF (float32 and bf16) and FP8 without scaled FP8 "
        f"products (bf16), plus {CONTEXT_GB:.0f} GB for the CUDA context and allocator slack.",
        "* Pinned host memory: what offload low or balanced holds on the host (the whole tower's layers); "
        "loading holds the checkpoint's own copy beside it until the model is ready.",
        "* The prompt encoder is another model: its own tower (the token embedding and output head, "
        "151,936 rows each, stay bf16), its own process and context; the second table puts it on the same "
        "card, holding one forward of 4,096 tokens. It has no FP8 mode, so an FP8 row counts it in bf16.",
    ])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench")
    args = p.parse_args(argv)
    write_report(Path(args.out) / "offload_memory.md", "GPU memory per tower, weight format and layer offload",
                 f"{assumptions()}\n\n### One generation model\n\n{table()}\n\n### A generation model and its "
                 f"prompt encoder on one card, at 2048x2048\n\n{together()}")


if __name__ == "__main__":
    main()
