"""The loss curves of the demo's three training runs, from their ``training_log.json`` files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RUNS = (("dense", "dense model, both towers"), ("moe", "MoE upcycling"), ("lora", "8-step LoRA distillation"))


def main(argv: list[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.common import save_figure

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, default=Path("demo/checkpoints"))
    args = parser.parse_args(argv)
    runs = [(name, label, json.loads((args.dir / name / "training_log.json").read_text()))
            for name, label in RUNS if (args.dir / name / "training_log.json").is_file()]
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.2), squeeze=False)
    for ax, (_, label, run) in zip(axes[0], runs):
        steps = [e["step"] for e in run["log"]]
        ax.plot(steps, [e["loss"] for e in run["log"]])
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (mean over the logging window)")
        ax.set_title(f"{label}\n{run['seconds'] / 60:.1f} min", fontsize=9)
    out = args.dir / "loss_curves.png"
    save_figure(fig, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
