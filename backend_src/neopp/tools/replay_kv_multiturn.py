"""`replay_kv_multiturn`: several turns of one chat with one loaded pipeline.

Turns come from the command line (`--turn`, repeated) or a JSON file (`--turns`):

    --turn COND,UNCOND,OFFSET_COND,OFFSET_UNCOND,SEED      (UNCOND, OFFSET_UNCOND, SEED may be 'none')

    {"turns": [{"cond": "t0_cond.pt", "uncond": "t0_uncond.pt", "offset_cond": 298,
                "offset_uncond": 9, "seed": 200},
               {"cond": "t1_cond.pt", "uncond": "t1_uncond.pt", "offset_cond": 366,
                "offset_uncond": 12}]}

(relative paths in the JSON file resolve against its folder; a bare list works too).
A turn without a seed continues the stream where the previous turn left it, exactly as a
session of the server does. Results: `<output_dir>/<output_prefix>_<turn>.png`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import InputError
from .replay_common import Turn, add_common_args, parse_optional_int, replay, run_main


def parse_turn(text: str) -> Turn:
    """`COND,UNCOND,OFFSET_COND,OFFSET_UNCOND,SEED`; trailing fields may be left out."""
    parts = [p.strip() for p in text.split(",")]
    if not 2 <= len(parts) <= 5 or not parts[0]:
        raise InputError(f"--turn {text!r}: expected COND,UNCOND,OFFSET_COND,OFFSET_UNCOND,SEED")
    parts += ["none"] * (5 - len(parts))
    uncond = None if parts[1].lower() in ("", "none", "-") else Path(parts[1])
    offset_cond = parse_optional_int(parts[2], f"--turn {text!r}: OFFSET_COND")
    if offset_cond is None:
        raise InputError(f"--turn {text!r}: OFFSET_COND is required")
    return Turn(cond=Path(parts[0]), uncond=uncond, offset_cond=offset_cond,
                offset_uncond=parse_optional_int(parts[3], f"--turn {text!r}: OFFSET_UNCOND"),
                seed=parse_optional_int(parts[4], f"--turn {text!r}: SEED"))


def load_turns(path: Path) -> list[Turn]:
    """Turns from a JSON file (plain data: nothing is executed or unpickled)."""
    try:
        raw: Any = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"--turns {path}: cannot read JSON ({exc})") from exc
    items = raw.get("turns") if isinstance(raw, dict) else raw
    if not isinstance(items, list) or not items:
        raise InputError(f"--turns {path}: expected a non-empty list of turns (or {{'turns': [...]}})")

    def resolve(value: Any) -> Path | None:
        if value in (None, "", "none"):
            return None
        p = Path(str(value))
        return p if p.is_absolute() else path.parent / p

    turns = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or "cond" not in item or "offset_cond" not in item:
            raise InputError(f"--turns {path}: turn {i} needs at least 'cond' and 'offset_cond'")
        turns.append(Turn(cond=resolve(item["cond"]), uncond=resolve(item.get("uncond")),
                          offset_cond=int(item["offset_cond"]),
                          offset_uncond=parse_optional_int(item.get("offset_uncond"), f"turn {i} offset_uncond"),
                          seed=parse_optional_int(item.get("seed"), f"turn {i} seed")))
    return turns


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replay_kv_multiturn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--turn", action="append", default=[], help="COND,UNCOND,OFFSET_COND,OFFSET_UNCOND,SEED")
    parser.add_argument("--turns", type=Path, help="JSON file of turns (instead of --turn)")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--output-prefix", default="turn")
    return parser


def run(args: argparse.Namespace) -> None:
    if bool(args.turn) == bool(args.turns):
        raise InputError("give the turns either with --turn (repeated) or with --turns FILE.json")
    turns = [parse_turn(t) for t in args.turn] if args.turn else load_turns(args.turns)
    replay(args, [(turn, args.output_dir / f"{args.output_prefix}_{i}.png") for i, turn in enumerate(turns)])


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(run, argv, build_parser())


if __name__ == "__main__":
    raise SystemExit(main())
