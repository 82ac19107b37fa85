"""LightLLM's KV dump names, so a replay need not be told the offsets by hand.

LightLLM saves a request's prefixes as `to_x2v_cond_kv_<turn>_<len>.pt` and
`to_x2v_uncond_kv_<turn>_<len>.pt`, where `<len>` is the prefix length that request used as
its RoPE index offset; one-turn dumps may leave the turn out (`to_x2v_cond_kv_325.pt`,
read as turn 0). An offset given explicitly always wins: a dump may have been renamed, and
LightLLM's own log is the authority when the two differ.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

BRANCHES = ("cond", "uncond")
_NAME = re.compile(r"to_x2v_(cond|uncond)_kv_(?:(\d{1,4})_)?(\d{1,7})\.pt")
RULE = "to_x2v_<cond|uncond>_kv_<turn>_<len>.pt (or to_x2v_<cond|uncond>_kv_<len>.pt for turn 0)"


@dataclass(frozen=True)
class DumpName:
    """What a dump's file name says about it."""

    branch: str
    turn: int
    length: int


def parse_dump_name(path: str | Path) -> DumpName:
    """The branch, turn and prefix length in a LightLLM dump name; a clear error otherwise."""
    match = _NAME.fullmatch(Path(path).name)
    if match is None:
        raise InputError(f"{path}: not a LightLLM dump name, which is {RULE}; "
                         "give its offset explicitly (OFFSET_COND / OFFSET_UNCOND)")
    branch, turn, length = match.groups()
    return DumpName(branch, int(turn or 0), int(length))


def find_dump(folder: str | Path, branch: str, turn: int) -> Path | None:
    """The one dump of `branch` for `turn` in `folder`, or None when there is none.

    Two candidates (say turn 0 with two lengths) are refused rather than guessed between.
    """
    root = Path(folder)
    if not root.is_dir():
        raise InputError(f"KV_DIR {root}: does not exist or is not a folder")
    found = []
    for path in sorted(root.glob(f"to_x2v_{branch}_kv_*.pt")):
        try:
            name = parse_dump_name(path)
        except InputError:
            continue  # another file that merely starts alike
        if name.branch == branch and name.turn == turn:
            found.append(path)
    if len(found) > 1:
        raise InputError(f"KV_DIR {root}: {len(found)} {branch} dumps for turn {turn} "
                         f"({', '.join(p.name for p in found)}); keep one or name the file explicitly")
    return found[0] if found else None


def offset_of(path: str | Path, explicit: str | int | None, what: str = "offset") -> int:
    """The index offset for a dump: the explicit one when given, else the length in its name."""
    if explicit is not None and str(explicit).strip() != "":
        try:
            return int(explicit)
        except ValueError as exc:
            raise InputError(f"{what}: expected an integer, got {explicit!r}") from exc
    return parse_dump_name(path).length
