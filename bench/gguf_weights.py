"""GGUF block-quantized weights: their memory, the time a layer's linears take, the demo's image.

    python -m bench.gguf_weights [--out bench] [--rounds 3] [--tokens 256] [--steps 20]

1. The seven linears of one decoder layer at the 8B geometry (hidden 4096, 32 query and 8
   key/value heads of 128, MLP 12288), random weights, held in float32 (what the CPU runs), as
   Q8_0 and as Q4_K (``GGUFLinear``: the blocks in memory, dequantized each call). Each round runs
   ``--tokens`` rows through all seven under each holding, the order alternating; printed are
   the weights' bytes against bf16 and the median time against float32.
2. The demo checkpoint written as Q8_0 and Q4_0 (quantized from its weights by the ``gguf``
   package, which has no quantizer for the K types) draws its sample prompt at 256x256; printed
   is each image's PSNR against the float32 demo's.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import quants

from bench.common import REPO, load_note, section_main
from neopp.model.gguf_checkpoint import GGUFLinear, GGUFWeight
from neopp.model.kv_cache import load_kv_file
from neopp.model.layers import Linear
from neopp.modes import load_mode
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from neopp.sampling.sampler import to_pixels
from testing.tiny_gguf import random_blocks, write_gguf

DEMO = REPO / "demo" / "checkpoints" / "dense"
HIDDEN, Q_OUT, KV_OUT, MLP = 4096, 32 * 128, 8 * 128, 12288
LAYER = {"q_proj": (Q_OUT, HIDDEN), "k_proj": (KV_OUT, HIDDEN), "v_proj": (KV_OUT, HIDDEN), "o_proj": (HIDDEN, Q_OUT),
         "gate_proj": (MLP, HIDDEN), "up_proj": (MLP, HIDDEN), "down_proj": (HIDDEN, MLP)}


def holdings(seed: int = 0) -> dict[str, list[Linear]]:
    """The layer's linears held three ways (the quantized ones from the same random weights for
    Q8_0; Q4_K as random valid blocks: the package has no K quantizer, and its time and memory
    do not depend on the values)."""
    rng = np.random.default_rng(seed)
    out: dict[str, list[Linear]] = {"float32": [], "Q8_0": [], "Q4_K": []}
    cpu = torch.device("cpu")
    for shape in LAYER.values():
        weight = (rng.standard_normal(shape, dtype=np.float32) * 0.02)
        out["float32"].append(Linear(torch.from_numpy(weight)))
        q8 = quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
        out["Q8_0"].append(GGUFLinear(GGUFWeight(torch.from_numpy(q8), "Q8_0", shape), cpu))
        q4 = random_blocks("Q4_K", shape, rng)
        out["Q4_K"].append(GGUFLinear(GGUFWeight(torch.from_numpy(q4), "Q4_K", shape), cpu))
    return out


def run_layer(linears: list[Linear], x: torch.Tensor) -> None:
    q, k, v, o, gate, up, down = linears
    attn = q(x)
    k(x), v(x)
    o(attn)
    down(torch.nn.functional.silu(gate(x)) * up(x))


def layer_table(rounds: int, tokens: int) -> list[str]:
    held = holdings()
    x = torch.randn(tokens, HIDDEN) * 0.1
    times: dict[str, list[float]] = {name: [] for name in held}
    names = list(held)
    for r in range(rounds + 1):  # round 0 warms up
        for name in names if r % 2 == 0 else reversed(names):
            began = time.perf_counter()
            run_layer(held[name], x)
            if r:
                times[name].append(time.perf_counter() - began)
    bf16 = sum(lin.weight.numel() for lin in held["float32"]) * 2
    base = statistics.median(times["float32"])
    rows = ["| weights held as | bytes of the layer's linears | against bf16 | time of one pass | against float32 |",
            "|---|---|---|---|---|"]
    for name, linears in held.items():
        nbytes = sum(lin.nbytes() for lin in linears)
        t = statistics.median(times[name])
        rows.append(f"| {name} | {nbytes / 2**20:.0f} MiB | {nbytes / bf16:.2f}x | {t * 1000:.0f} ms | "
                    f"{t / base:.2f}x |")
    return rows


def demo_request(steps: int) -> GenerationRequest:
    kv = DEMO / "sample_kv"
    offsets = json.loads((kv / "offsets.json").read_text())
    sampling = load_mode(REPO / "configs" / "neopp" / "neopp_dense.json").sampling_params.replace(infer_steps=steps)
    return GenerationRequest(cond_kv=load_kv_file(kv / "cond_kv.pt"), uncond_kv=load_kv_file(kv / "uncond_kv.pt"),
                             index_offset_cond=int(offsets["index_offset_cond"]),
                             index_offset_uncond=int(offsets["index_offset_uncond"]), height=256, width=256,
                             noise=NoiseStream(7).draw(256, 256), sampling_params=sampling)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def demo_table(steps: int) -> list[str]:
    mode = load_mode(REPO / "configs" / "neopp" / "neopp_dense.json")
    full = to_pixels(NeoPPPipeline.from_pretrained(DEMO, mode, "cpu", torch.float32).sample(demo_request(steps)))
    rows = ["| weights | PSNR of the image against float32 |", "|---|---|"]
    with tempfile.TemporaryDirectory() as folder:
        for kind in ("Q8_0", "Q4_0"):
            file = write_gguf(DEMO, Path(folder) / kind, kind)
            pipe = NeoPPPipeline.from_pretrained(file, mode, "cpu", torch.float32)
            rows.append(f"| {kind} | {psnr(to_pixels(pipe.sample(demo_request(steps))), full):.1f} dB |")
    return rows


def body(args) -> str:  # noqa: ANN001 - the section's parsed flags
    torch.manual_seed(0)
    lines = [f"One decoder layer's seven linears at the 8B geometry, {args.tokens} rows, median of "
             f"{args.rounds} alternating rounds on this machine's CPU:", "", *layer_table(args.rounds, args.tokens), "",
             "The blocks hold about half (Q8_0) and a quarter (Q4_K) of bf16's bytes. On the CPU each call "
             "dequantizes the whole weight before its product: that is the time against float32.",
             "", f"The demo's sample prompt at 256x256, {args.steps} steps, its checkpoint quantized "
             "(decoder-layer linears of both towers):", "", *demo_table(args.steps), "", load_note()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    section_main(argv, __doc__, "gguf_weights.md", "GGUF weights: memory, layer time, the demo's image", body,
                 rounds=3, tokens=256, steps=20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
