"""Image quality of every mode on the demo model, judged on held-out prompts, side by side.

Each mode draws the same held-out prompts with the same seeds; the judge (demo.shapes) reads
background, shape colour, position and shape back from each image. The parallel modes must
draw the very images of the dense one; the table says how many they matched.

    python -m bench.demo_quality --n 200              # the table in bench/demo_quality.md
    python -m bench.demo_quality --grid docs/images/demo_grid.png   # and the README's picture
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bench.common import REPO, write_report
from demo import shapes
from neopp.engines.factory import build_engine
from neopp.engines.spec import EngineSpec
from neopp.modes import ModeSpec, load_mode
from neopp.request import GenerationRequest
from neopp.sampling.rng import NoiseStream
from neopp.text.language_tower import LanguageTower

MODES = REPO / "configs" / "neopp"
DEMO = REPO / "demo" / "checkpoints"


@dataclass(frozen=True)
class Row:
    label: str
    mode_file: str
    checkpoint: str                 # "dense" or "moe"
    overrides: dict = field(default_factory=dict)
    same_as: str | None = None      # a row whose images this one must reproduce exactly


ROWS = (
    Row("dense, 50 steps, CFG 4", "neopp_dense.json", "dense"),
    Row("dense, CFG off", "neopp_dense.json", "dense", {"enable_cfg": False}),
    Row("FP8", "neopp_dense_fp8.json", "dense"),
    Row("CFG-parallel (2 ranks)", "neopp_dense_parallel_cfg.json", "dense", same_as="dense, 50 steps, CFG 4"),
    Row("CFG + Ulysses (4 ranks)", "neopp_dense_parallel_cfg_seq.json", "dense", same_as="dense, 50 steps, CFG 4"),
    Row("MoE, 50 steps, CFG 4", "neopp_moe.json", "moe"),
    Row("MoE CFG-parallel (2 ranks)", "neopp_moe_parallel_cfg.json", "moe", same_as="MoE, 50 steps, CFG 4"),
    Row("8-step LoRA, no CFG", "neopp_dense_8steps.json", "dense"),
    Row("8 steps without the LoRA, no CFG", "neopp_dense.json", "dense", {"infer_steps": 8, "enable_cfg": False}),
)


def mode_of(row: Row, lora_dir: Path) -> ModeSpec:
    mode = load_mode(MODES / row.mode_file, lora_dir=lora_dir)
    if not row.overrides:
        return mode
    return dataclasses.replace(mode, sampling_params=mode.sampling_params.replace(**row.overrides))


def draw(row: Row, ckpt: Path, lora_dir: Path, scenes: list, size: tuple[int, int]) -> tuple[list, float]:
    """Every scene's image (seed = its index) and the seconds per image."""
    tower = LanguageTower.from_pretrained(ckpt)
    mode = mode_of(row, lora_dir)
    engine = build_engine(EngineSpec.local(ckpt, mode, "cpu", dtype=torch.float32))
    uncond, off_u = tower.encode("")
    images, began = [], time.perf_counter()
    try:
        for i, scene in enumerate(scenes):
            cond, off_c = tower.encode(scene.prompt)
            req = GenerationRequest(cond_kv=cond, index_offset_cond=off_c, uncond_kv=uncond,
                                    index_offset_uncond=off_u, height=size[0], width=size[1],
                                    noise=NoiseStream(i).draw(*size), sampling_params=mode.sampling_params)
            images.append(engine.generate(req))
    finally:
        engine.close()
    return images, (time.perf_counter() - began) / max(1, len(scenes))


def table(results: dict[str, dict], n: int, size: tuple[int, int]) -> str:
    lines = [f"{n} held-out prompts (never seen in training), {size[0]}x{size[1]}, seed = prompt index, "
             "float32 on the CPU.", "",
             "| mode | overall | background | colour | position | shape | s/image | pixels against |",
             "|---|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        s = r["score"]
        same = r.get("same", "")
        lines.append(f"| {label} | **{s['overall']:.1%}** | {s['background']:.1%} | {s['color']:.1%} | "
                     f"{s['position']:.1%} | {s['shape']:.1%} | {r['seconds']:.2f} | {same} |")
    return "\n".join(lines)


def save_grid(results: dict[str, dict], scenes: list, path: Path) -> None:
    """Prompts down, modes across: the README's picture."""
    import matplotlib.pyplot as plt

    from bench.common import save_figure

    labels = list(results)
    fig, axes = plt.subplots(len(scenes), len(labels), figsize=(1.9 * len(labels), 1.9 * len(scenes)),
                             squeeze=False)
    for i, scene in enumerate(scenes):
        for j, label in enumerate(labels):
            ax = axes[i][j]
            ax.imshow(results[label]["images"][i])
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(label, fontsize=7)
            if j == 0:
                ax.set_ylabel(scene.prompt.replace(" on a ", "\non a "), fontsize=6)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200, help="held-out prompts (at most 200)")
    parser.add_argument("--size", type=int, nargs=2, default=(256, 256))
    parser.add_argument("--rows", nargs="*", help="labels of the rows to run (default: all whose weights exist)")
    parser.add_argument("--dense", type=Path, default=DEMO / "dense")
    parser.add_argument("--moe", type=Path, default=DEMO / "moe")
    parser.add_argument("--lora-dir", type=Path, default=DEMO / "lora")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "demo_quality.md")
    parser.add_argument("--grid", type=Path, help="also save a prompts x modes picture here")
    args = parser.parse_args(argv)
    scenes = shapes.held_out_scenes()[: args.n]
    ckpts = {"dense": args.dense, "moe": args.moe}
    results: dict[str, dict] = {}
    for row in ROWS:
        if args.rows and row.label not in args.rows:
            continue
        lora_missing = "lora_configs" in (MODES / row.mode_file).read_text() and not args.lora_dir.is_dir()
        if not (ckpts[row.checkpoint] / "config.json").is_file() or lora_missing:
            print(f"skipped (no weights): {row.label}")
            continue
        images, seconds = draw(row, ckpts[row.checkpoint], args.lora_dir, scenes, tuple(args.size))
        results[row.label] = {"images": images, "seconds": seconds,
                              "score": shapes.score(images, scenes)}
        if row.same_as in results:
            ref = results[row.same_as]["images"]
            hits = sum(np.array_equal(a, b) for a, b in zip(images, ref))
            worst = max(int(np.abs(a.astype(int) - b.astype(int)).max()) for a, b in zip(images, ref))
            results[row.label]["same"] = f"{row.same_as}: {hits}/{len(images)} identical, max diff {worst}"
        print(row.label, results[row.label]["score"], flush=True)
    write_report(args.out, "Demo model: image quality per mode", table(results, len(scenes), tuple(args.size)))
    if args.grid:  # six prompts spread over the held-out set
        picks = list(range(0, len(scenes), max(1, len(scenes) // 6)))[:6]
        save_grid({k: {"images": [r["images"][i] for i in picks]} for k, r in results.items()},
                  [scenes[i] for i in picks], args.grid)


if __name__ == "__main__":
    main()
