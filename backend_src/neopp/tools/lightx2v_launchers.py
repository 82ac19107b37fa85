"""LightX2V's NeoPP launchers (`run_neopp_*.sh`) as data: one request each, through `replay_kv`.

    python -m neopp.tools.lightx2v_launchers run_neopp_dense_t2i_1k [more replay_kv flags]
    python -m neopp.tools.lightx2v_launchers --list

`scripts/lightx2v/<name>.sh` call this with their own name. Each replays one LightLLM dump
from `$KV_DIR`: `to_x2v_cond_kv_<turn>_<len>.pt` and `to_x2v_uncond_kv_<turn>_<len>.pt` of
`$TURN` (default 0), with `<len>` as the index offset unless OFFSET_COND / OFFSET_UNCOND are
set. Sampling values are the mode file's (LightX2V's launchers take theirs from the JSON).
These environment variables override a launcher:

    CKPT MODE NPROC KV_DIR TURN COND_KV UNCOND_KV (explicit files) OFFSET_COND OFFSET_UNCOND
    SEED (none: continue a random stream) SIZE="H W" STEPS OUT_DIR OUTPUT (the image path)

A launcher with two processes (CFG-parallel) runs under `torchrun --standalone` by itself.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from . import replay_kv
from .dump_names import RULE, find_dump, offset_of
from .replay_cases import MOE, base_path, launch


@dataclass(frozen=True)
class Launcher:
    """What LightX2V's launcher of the same name replays (its seed, size, mode and ranks)."""

    about: str
    mode: str                       # file under configs/neopp/
    kv: str                         # default folder under replay_kv/ (LightX2V's dump folder name)
    size: tuple[int, int]
    checkpoint: str = "checkpoints/neopp"
    task: str = "t2i"
    nproc: int = 1
    seed: int = 200


LAUNCHERS: dict[str, Launcher] = {
    "run_neopp_dense_t2i_1k": Launcher("dense t2i", "neopp_dense.json", "neopp_dense_kv_1k", (1024, 1024)),
    "run_neopp_dense_i2i_1k": Launcher("dense i2i (the input image is inside both prefixes)", "neopp_dense.json",
                                       "neopp_dense_i2i_kv_1k", (1024, 1024), task="i2i"),
    "run_neopp_dense_t2i_1k_cfg2": Launcher("dense t2i on 2 CFG ranks", "neopp_dense_parallel_cfg.json",
                                            "neopp_dense_kv_1k", (1024, 1024), nproc=2),
    "run_neopp_moe_t2i_1k": Launcher("MoE t2i", "neopp_moe.json", "neopp_moe_kv", (1024, 1024), checkpoint=MOE),
    "run_neopp_moe_t2i_1k_cfg2": Launcher("MoE t2i on 2 CFG ranks", "neopp_moe_parallel_cfg.json", "neopp_moe_kv",
                                          (1024, 1024), checkpoint=MOE, nproc=2),
    "run_neopp_moe_t2i_512": Launcher("MoE t2i at 512", "neopp_moe.json", "neopp_moe_kv", (512, 512),
                                      checkpoint=MOE),
}


def dump_paths(kv_dir: str, env: Mapping[str, str]) -> tuple[Path, Path]:
    """The cond and uncond dumps: COND_KV / UNCOND_KV, else `$TURN`'s pair in the folder."""
    try:
        turn = int(env.get("TURN") or 0)
    except ValueError as exc:
        raise InputError(f"TURN: expected a turn number, got {env['TURN']!r}") from exc
    paths = []
    for branch in ("cond", "uncond"):
        given = env.get(f"{branch.upper()}_KV")
        found = Path(given) if given else find_dump(kv_dir, branch, turn)
        if found is None:
            raise InputError(f"KV_DIR {kv_dir}: no {branch} dump for turn {turn}; expected {RULE}")
        paths.append(found)
    return paths[0], paths[1]


def launcher_argv(name: str, env: Mapping[str, str]) -> tuple[int, list[str]]:
    """(process count, replay_kv arguments) for launcher `name` under the overrides in `env`."""
    spec = LAUNCHERS[name]

    def pick(var: str, default: object) -> str:
        return env.get(var) or str(default)

    cond, uncond = dump_paths(pick("KV_DIR", base_path(f"replay_kv/{spec.kv}", env)), env)
    output = pick("OUTPUT", f"{pick('OUT_DIR', base_path('outputs/replay', env))}/{name.removeprefix('run_')}.png")
    argv = ["--checkpoint", pick("CKPT", base_path(spec.checkpoint, env)),
            "--mode", pick("MODE", base_path(f"configs/neopp/{spec.mode}", env)),
            "--task", spec.task, "--size", *(env.get("SIZE") or f"{spec.size[0]} {spec.size[1]}").split(),
            "--cond-kv", str(cond), "--uncond-kv", str(uncond),
            "--offset-cond", str(offset_of(cond, env.get("OFFSET_COND"), "OFFSET_COND")),
            "--offset-uncond", str(offset_of(uncond, env.get("OFFSET_UNCOND"), "OFFSET_UNCOND")),
            "--seed", pick("SEED", spec.seed), "--output", output]
    argv += ["--steps", env["STEPS"]] if env.get("STEPS") else []
    nproc = pick("NPROC", spec.nproc)
    if not nproc.isdigit():
        raise InputError(f"NPROC: expected a process count, got {nproc!r}")
    return int(nproc), argv


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m neopp.tools.lightx2v_launchers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", choices=sorted(LAUNCHERS), metavar="NAME", help="a launcher (--list)")
    parser.add_argument("--list", action="store_true", help="print the launchers and exit")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="more replay_kv flags, e.g. --device cpu")
    args = parser.parse_args(argv)
    if args.list or args.name is None:
        for name, spec in sorted(LAUNCHERS.items()):
            print(f"{name:28} {spec.mode:30} {spec.nproc} proc  {spec.size[0]}x{spec.size[1]} "
                  f"seed {spec.seed}  {spec.about}")
        return 0 if args.list else 2
    try:
        nproc, tool_argv = launcher_argv(args.name, os.environ)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return launch(replay_kv, tool_argv + args.flags, nproc)


if __name__ == "__main__":
    raise SystemExit(main())
