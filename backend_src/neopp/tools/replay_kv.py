"""`replay_kv`: one image from saved KV prefixes, offline, with the serving code path.

Example (dense, 1K, seed 200)::

    replay_kv --checkpoint CKPT --mode configs/neopp/neopp_dense.json \\
        --cond-kv cond.pt --uncond-kv uncond.pt --offset-cond 325 --offset-uncond 9 \\
        --seed 200 --size 1024 1024 --output out/dense_t2i.png

Sampling values come from the mode file; `--steps`, `--cfg-scale`, `--cfg-interval`,
`--cfg-norm`, `--timestep-shift`, `--image-guidance-scale`, `--no-cfg` override one each.
Image editing adds the image branch (the input images without the prompt): `--image-kv` and
`--offset-image`; `--image-guidance-scale` other than 1 needs it. Without `--seed` the stream
continues: from `--state-in` (a previous run's `--state-out`), else from a random one.
A parallel mode runs under `torchrun --standalone --nproc_per_node=N`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from .replay_common import Turn, add_common_args, parse_optional_int, replay, run_main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replay_kv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--cond-kv", type=Path, required=True, help="cond prefix (.pt or .safetensors)")
    parser.add_argument("--uncond-kv", type=Path, help="uncond prefix; needed whenever a step uses guidance")
    parser.add_argument("--offset-cond", type=int, required=True, help="index offset of the cond branch")
    parser.add_argument("--offset-uncond", type=int, help="index offset of the uncond branch")
    parser.add_argument("--image-kv", type=Path, help="image editing: the image-branch prefix (images, no prompt)")
    parser.add_argument("--offset-image", type=int, help="index offset of the image branch")
    parser.add_argument("--seed", help="integer seed; omitted or 'none': continue the stream")
    parser.add_argument("--output", type=Path, required=True, help="image path (.png, .jpg, .webp)")
    return parser


def run(args: argparse.Namespace) -> None:
    turn = Turn(cond=args.cond_kv, uncond=args.uncond_kv, offset_cond=args.offset_cond,
                offset_uncond=args.offset_uncond, seed=parse_optional_int(args.seed, "--seed"),
                image=args.image_kv, offset_image=args.offset_image)
    replay(args, [(turn, args.output)])


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(run, argv, build_parser())


if __name__ == "__main__":
    raise SystemExit(main())
