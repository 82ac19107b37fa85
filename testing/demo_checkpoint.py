"""A demo-format checkpoint with random weights: both towers and a tokenizer, at the demo model's
geometry. Tests and ``make serve`` use it where a prompt encoder must load before the trained
weights are there; images from it are noise.

CLI: ``python -m testing.demo_checkpoint --out DIR``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from demo.model import demo_config, demo_tokenizer, init_weights, save_checkpoint

DEMO_WORDS = ("a red green blue circle square triangle on the left right at top bottom in center "
              "background").split()


def write_demo_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """config.json, the tokenizer files and model.safetensors (bf16), deterministic for a seed."""
    cfg, tokenizer = demo_config(), demo_tokenizer(DEMO_WORDS)
    return save_checkpoint(Path(out_dir), cfg, tokenizer, init_weights(cfg, len(tokenizer.vocab), seed))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="checkpoint folder to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"wrote {write_demo_checkpoint(args.out, args.seed)}")


if __name__ == "__main__":
    main()
