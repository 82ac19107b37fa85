"""The replay set as data: each captured chat is one row of `CASES`, replayed by its name.

    python -m neopp.tools.replay_cases dense_t2i_1k [more replay_kv_multiturn flags]
    python -m neopp.tools.replay_cases --list

`scripts/replay/<case>.sh` call this with their own name. Relative default paths (checkpoint,
KV folder, mode file) resolve against `NEOPP_BASE_DIR` (the scripts set it to the checkout),
else the current directory. Turn `i` reads `$KV_DIR/turn<i>_cond.pt`, LightLLM's
`to_x2v_cond_kv_<i>_<len>.pt` when that is what the folder holds, or, for a one-turn case,
`cond_kv.pt` (the demo's sample naming), and, when the turn has an uncond offset, the uncond file named alike; the
case's offsets are LightLLM's logged ones and win over the lengths in the names. Images land
in `$OUT_DIR/<prefix>_<i>.png`. These environment variables override a case:

    CKPT LORA_DIR MODE NPROC KV_DIR OUT_DIR PREFIX TASK SIZE="H W" CFG_SCALE CFG_INTERVAL="LOW HIGH"
    CFG_NORM SHIFT STEPS SEEDS="200 none none" (one per turn; none continues the stream)
    OFFSET_COND OFFSET_UNCOND (one-turn cases: the offsets LightLLM logged with the KV)

A case with more than one process (CFG-parallel) runs under torch's elastic launcher
(`torchrun --standalone`); NPROC must stay the mode file's process count.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ..errors import InputError
from . import replay_kv_multiturn
from .dump_names import find_dump

DENSE_CHAT = ((298, 9, 200), (366, 12, 201), (441, 15, 202))  # offsets cond/uncond, seed per turn
MOE_TURN = ((325, 9, 200),)


@dataclass(frozen=True)
class Case:
    """One replay: what the captured KV was made with and how its images were sampled."""

    about: str
    mode: str                                        # file under configs/neopp/
    kv: str                                          # the KV folder
    size: tuple[int, int]
    turns: tuple[tuple[int, int | None, int | None], ...]
    checkpoint: str = "checkpoints/neopp"
    task: str = "t2i"
    nproc: int = 1
    cfg_scale: float = 4.0
    cfg_interval: tuple[float, float] = (-1.0, 2.0)
    config: bool = True
    cfg_norm: str = "none"


MOE = "checkpoints/neopp_moe"
LORA_DIR = "checkpoints/lora"  # where a mode file's LoRA file names are looked up (as the 8-step model's lora_dir)
CASES: dict[str, Case] = {
    "demo": Case("the embedded demo model on its sample prompt's KV (runs on a CPU in seconds)",
                 "neopp_dense.json", "demo/checkpoints/dense/sample_kv", (256, 256), ((11, 1, 7),),
                 checkpoint="demo/checkpoints/dense", cfg_norm="global"),
    "dense_t2i_1k": Case("dense t2i, three explicitly seeded turns", "neopp_dense.json", "replay_kv/dense_t2i_1k",
                         (1024, 1024), DENSE_CHAT),
    "dense_i2i_1k": Case("dense i2i (the input image is inside both prefixes), one turn", "neopp_dense.json",
                         "replay_kv/dense_i2i_1k", (1024, 1024), ((298, 9, 200),), task="i2i"),
    "dense_cfg_parallel_1k": Case("dense_t2i_1k on 2 CFG ranks: its images must match dense_t2i_1k",
                                  "neopp_dense_parallel_cfg.json", "replay_kv/dense_t2i_1k", (1024, 1024), DENSE_CHAT,
                                  nproc=2),
    "dense_3turn_2k": Case("dense 2K chat: seed 200, then the stream continues", "neopp_dense.json",
                           "replay_kv/dense_3turn_2k", (2048, 2048), ((298, 9, 200), (366, 12, None), (441, 15, None))),
    "dense_8steps_lora_2k": Case("dense 8-step LoRA, CFG off (no uncond prefix)", "neopp_dense_8steps.json",
                                 "replay_kv/dense_8steps_2k", (2048, 2048), ((298, None, 200),),
                                 cfg_scale=1.0, config=False),
    "moe_t2i_1k": Case("MoE t2i, one turn", "neopp_moe.json", "replay_kv/moe_t2i_1k", (1024, 1024), MOE_TURN,
                       checkpoint=MOE, cfg_interval=(0.0, 1.0)),
    "moe_cfg_parallel_1k": Case("moe_t2i_1k on 2 CFG ranks", "neopp_moe_parallel_cfg.json", "replay_kv/moe_t2i_1k",
                                (1024, 1024), MOE_TURN, checkpoint=MOE, nproc=2, cfg_interval=(0.0, 1.0)),
    "moe_512": Case("MoE t2i at 512 (SIZE='2048 2048' for the 2K run)", "neopp_moe.json", "replay_kv/moe_512",
                    (512, 512), MOE_TURN, checkpoint=MOE, cfg_interval=(0.0, 1.0)),
}


def _words(env: Mapping[str, str], name: str, default: Sequence[object]) -> list[str]:
    """A space-separated override (`SIZE="512 512"`); empty counts as unset, as in the shell."""
    return (env.get(name) or " ".join(map(str, default))).split()


def _turns(case: Case, env: Mapping[str, str]) -> list[tuple[object, object, object]]:
    """The case's turns with SEEDS / OFFSET_COND / OFFSET_UNCOND applied."""
    turns = [list(t) for t in case.turns]
    seeds = _words(env, "SEEDS", ["none" if t[2] is None else t[2] for t in turns])
    if len(seeds) != len(turns):
        raise InputError(f"SEEDS: this case has {len(turns)} turns, got {len(seeds)} seeds")
    for turn, seed in zip(turns, seeds):
        turn[2] = seed
    for index, name in ((0, "OFFSET_COND"), (1, "OFFSET_UNCOND")):
        if env.get(name):
            if len(turns) != 1:
                raise InputError(f"{name} applies to one-turn cases only; use replay_kv_multiturn --turn")
            turns[0][index] = env[name]
    return [tuple("none" if v is None else v for v in t) for t in turns]


def base_path(path: str, env: Mapping[str, str]) -> str:
    """A relative default path, under ``NEOPP_BASE_DIR`` when that is set."""
    base = env.get("NEOPP_BASE_DIR")
    return path if not base or Path(path).is_absolute() else str(Path(base) / path)


def kv_file(kv_dir: str, branch: str, turn: int) -> str:
    """`turn<i>_<branch>.pt`, or LightLLM's dump of that turn when only that is in the folder."""
    plain = f"{kv_dir}/turn{turn}_{branch}.pt"
    if Path(plain).exists() or not Path(kv_dir).is_dir():
        return plain
    sample = Path(kv_dir) / f"{branch}_kv.pt"
    if turn == 0 and sample.exists():
        return str(sample)
    dump = find_dump(kv_dir, branch, turn)
    return plain if dump is None else str(dump)


def _lora_dir(env: Mapping[str, str]) -> list[str]:
    """``--lora-dir`` when LORA_DIR names one, or the default folder exists: a folder that is not
    there is not passed (the tool then looks beside the mode file, and names what it misses)."""
    if env.get("LORA_DIR"):
        return ["--lora-dir", env["LORA_DIR"]]
    default = base_path(LORA_DIR, env)
    return ["--lora-dir", default] if Path(default).is_dir() else []


def case_argv(name: str, env: Mapping[str, str]) -> tuple[int, list[str]]:
    """(process count, replay_kv_multiturn arguments) for case `name` under the overrides in `env`."""
    case = CASES[name]

    def pick(var: str, default: object) -> str:
        return env.get(var) or str(default)

    kv_dir = pick("KV_DIR", base_path(case.kv, env))
    argv = ["--checkpoint", pick("CKPT", base_path(case.checkpoint, env)), *_lora_dir(env),
            "--mode", pick("MODE", base_path(f"configs/neopp/{case.mode}", env)),
            "--task", pick("TASK", case.task), "--size", *_words(env, "SIZE", case.size),
            "--cfg-scale", pick("CFG_SCALE", case.cfg_scale),
            "--cfg-interval", *_words(env, "CFG_INTERVAL", case.cfg_interval),
            "--cfg-norm", pick("CFG_NORM", case.cfg_norm), "--timestep-shift", pick("SHIFT", 3.0)]
    argv += ["--steps", env["STEPS"]] if env.get("STEPS") else []
    argv += [] if case.config else ["--no-cfg"]
    argv += ["--output-dir", pick("OUT_DIR", base_path("outputs/replay", env)), "--output-prefix", pick("PREFIX", name)]
    for i, (cond, uncond, seed) in enumerate(_turns(case, env)):
        uncond_file = "none" if uncond == "none" else kv_file(kv_dir, "uncond", i)
        argv += ["--turn", f"{kv_file(kv_dir, 'cond', i)},{uncond_file},{cond},{uncond},{seed}"]
    return int(pick("NPROC", case.nproc)), argv


def launch(tool: ModuleType, argv: Sequence[str], nproc: int) -> int:
    """Run a replay tool here, or under torchrun for a parallel mode; print the command first."""
    if nproc <= 1:
        print(f"+ {tool.__name__.rsplit('.', 1)[-1]} " + shlex.join(argv), file=sys.stderr, flush=True)
        return tool.main(list(argv))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", tool.__name__, *argv]
    print("+ " + shlex.join(command), file=sys.stderr, flush=True)
    return subprocess.run(command).returncode


def run_case(name: str, extra: Sequence[str], env: Mapping[str, str]) -> int:
    """Run one case, in this process or under torchrun."""
    nproc, argv = case_argv(name, env)
    return launch(replay_kv_multiturn, argv + list(extra), nproc)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m neopp.tools.replay_cases", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", nargs="?", choices=sorted(CASES), metavar="CASE", help="a case name (--list)")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("flags", nargs=argparse.REMAINDER,
                        help="more replay_kv_multiturn flags, e.g. --device cpu")
    args = parser.parse_args(argv)
    if args.list or args.case is None:
        for name, case in sorted(CASES.items()):
            print(f"{name:24} {case.mode:32} {case.nproc} proc  {case.about}")
        return 0 if args.list else 2
    try:
        return run_case(args.case, args.flags, os.environ)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
