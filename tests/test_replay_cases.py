"""The replay tables (cases, LightX2V's launchers) and LightLLM's dump names: arguments parse as intended."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from neopp.errors import InputError
from neopp.tools import replay_kv, replay_kv_multiturn
from neopp.tools.dump_names import DumpName, find_dump, offset_of, parse_dump_name
from neopp.tools.lightx2v_launchers import LAUNCHERS as LIGHTX2V
from neopp.tools.lightx2v_launchers import launcher_argv
from neopp.tools.replay_cases import CASES, case_argv, main

LAUNCHERS = Path(__file__).resolve().parents[1] / "scripts" / "replay"


def parsed(name: str, **env: str):
    """(process count, parsed flags, turns) exactly as replay_kv_multiturn will see them."""
    nproc, argv = case_argv(name, env)
    args = replay_kv_multiturn.build_parser().parse_args(argv)
    return nproc, args, [replay_kv_multiturn.parse_turn(t) for t in args.turn]


def scripts_by_name(folder: Path, module: str) -> set[str]:
    """The scripts of ``folder``, each checked to run ``module`` on the case named as the script."""
    named = set()
    for script in folder.glob("*.sh"):
        found = re.findall(rf"-m neopp\.tools\.{module} (\w+) ", script.read_text())
        assert found == [script.stem], script
        named.add(script.stem)
    return named


def test_each_launcher_runs_its_own_case_and_each_case_has_a_launcher():
    assert scripts_by_name(LAUNCHERS, "replay_cases") == set(CASES)


def test_defaults_of_a_continued_chat_and_of_a_parallel_case():
    nproc, args, turns = parsed("dense_3turn_2k")
    assert nproc == 1 and args.size == [2048, 2048] and args.output_prefix == "dense_3turn_2k"
    expected = [(298, 9, 200), (366, 12, None), (441, 15, None)]
    assert [(t.offset_cond, t.offset_uncond, t.seed) for t in turns] == expected
    assert str(turns[2].uncond) == "replay_kv/dense_3turn_2k/turn2_uncond.pt"
    nproc, args, turns = parsed("moe_cfg_parallel_1k")
    assert nproc == 2 and args.mode.endswith("neopp_moe_parallel_cfg.json")
    assert args.cfg_interval == [0.0, 1.0] and args.checkpoint == "checkpoints/neopp_moe"
    assert str(turns[0].cond).startswith("replay_kv/moe_t2i_1k/")


def test_cfg_off_case_has_no_uncond_prefix():
    _, args, turns = parsed("dense_8steps_lora_2k")
    assert args.enable_cfg is False and args.cfg_scale == 1.0
    assert str(parsed("dense_8steps_lora_2k", LORA_DIR="build/tiny/lora")[1].lora_dir) == "build/tiny/lora"
    assert turns[0].uncond is None and turns[0].offset_uncond is None and turns[0].seed == 200


def test_environment_overrides():
    nproc, args, turns = parsed("dense_i2i_1k", SIZE="64 96", STEPS="2", OFFSET_COND="31", OFFSET_UNCOND="5",
                                SEEDS="none", KV_DIR="/kv", NPROC="3", CFG_INTERVAL="0 1")
    assert (nproc, args.size, args.infer_steps, args.task) == (3, [64, 96], 2, "i2i")
    assert args.cfg_interval == [0.0, 1.0]
    assert (turns[0].offset_cond, turns[0].offset_uncond, turns[0].seed) == (31, 5, None)
    assert str(turns[0].cond) == "/kv/turn0_cond.pt"
    _, _, turns = parsed("dense_3turn_2k", SEEDS="200 201 202")
    assert [t.seed for t in turns] == [200, 201, 202]


def test_bad_overrides_are_refused(capsys):
    with pytest.raises(InputError, match="3 turns"):
        case_argv("dense_t2i_1k", {"SEEDS": "1 2"})
    with pytest.raises(InputError, match="one-turn"):
        case_argv("dense_t2i_1k", {"OFFSET_COND": "12"})
    assert main(["--list"]) == 0 and "moe_512" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["no_such_case"])


# ---- LightLLM dump names and LightX2V's launchers (scripts/lightx2v)

LX2V = LAUNCHERS.parent / "lightx2v"


def test_dump_names_parse_and_bad_names_are_refused():
    assert parse_dump_name("/kv/to_x2v_cond_kv_2_439.pt") == DumpName("cond", 2, 439)
    assert parse_dump_name("to_x2v_uncond_kv_9.pt") == DumpName("uncond", 0, 9)  # one-turn dumps name no turn
    for bad in ("cond.pt", "to_x2v_cond_kv_.pt", "to_x2v_cond_kv_1_2_3.pt", "to_x2v_kv_0_9.pt",
                "to_x2v_cond_kv_0_298.safetensors", "to_x2v_cond_kv_0_12345678.pt"):
        with pytest.raises(InputError, match="not a LightLLM dump name"):
            parse_dump_name(bad)
    assert offset_of("to_x2v_cond_kv_1_360.pt", None) == 360
    assert offset_of("to_x2v_cond_kv_1_360.pt", "366") == 366  # LightLLM's logged offset wins over the name
    assert offset_of("cond.pt", "298") == 298
    with pytest.raises(InputError, match="OFFSET_COND: expected an integer"):
        offset_of("cond.pt", "x", "OFFSET_COND")


def touch(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"")
    return folder


def test_find_dump_picks_the_turn_and_refuses_to_guess(tmp_path):
    kv = touch(tmp_path / "kv", "to_x2v_cond_kv_0_298.pt", "to_x2v_cond_kv_1_360.pt", "to_x2v_cond_kv_10_5.pt",
               "to_x2v_cond_kv_backup.pt", "notes.txt")
    assert find_dump(kv, "cond", 1).name == "to_x2v_cond_kv_1_360.pt"
    assert find_dump(kv, "cond", 10).name == "to_x2v_cond_kv_10_5.pt"
    assert find_dump(kv, "uncond", 0) is None
    touch(kv, "to_x2v_cond_kv_298.pt")  # turn 0 twice: with and without the turn in the name
    with pytest.raises(InputError, match="2 cond dumps for turn 0"):
        find_dump(kv, "cond", 0)
    with pytest.raises(InputError, match="does not exist"):
        find_dump(tmp_path / "missing", "cond", 0)


def lx2v_parsed(name: str, **env: str):
    nproc, argv = launcher_argv(name, env)
    return nproc, replay_kv.build_parser().parse_args(argv)


def test_each_lightx2v_script_runs_its_own_launcher_and_each_launcher_has_a_script():
    assert scripts_by_name(LX2V, "lightx2v_launchers") == set(LIGHTX2V) == {
        "run_neopp_dense_t2i_1k", "run_neopp_dense_i2i_1k", "run_neopp_dense_t2i_1k_cfg2",
        "run_neopp_moe_t2i_1k", "run_neopp_moe_t2i_1k_cfg2", "run_neopp_moe_t2i_512"}


# LightX2V's values: mode file, task, size, seed, ranks (its scripts/neopp launchers and their README table).
EXPECTED = {
    "run_neopp_dense_t2i_1k": ("neopp_dense.json", "t2i", [1024, 1024], "200", 1),
    "run_neopp_dense_i2i_1k": ("neopp_dense.json", "i2i", [1024, 1024], "200", 1),
    "run_neopp_dense_t2i_1k_cfg2": ("neopp_dense_parallel_cfg.json", "t2i", [1024, 1024], "200", 2),
    "run_neopp_moe_t2i_1k": ("neopp_moe.json", "t2i", [1024, 1024], "200", 1),
    "run_neopp_moe_t2i_1k_cfg2": ("neopp_moe_parallel_cfg.json", "t2i", [1024, 1024], "200", 2),
    "run_neopp_moe_t2i_512": ("neopp_moe.json", "t2i", [512, 512], "200", 1),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_launcher_defaults_are_lightx2v_values_and_offsets_come_from_the_names(name, tmp_path):
    kv = touch(tmp_path, "to_x2v_cond_kv_0_298.pt", "to_x2v_uncond_kv_0_9.pt")
    nproc, args = lx2v_parsed(name, KV_DIR=str(kv))
    mode, task, size, seed, ranks = EXPECTED[name]
    assert (Path(args.mode).name, args.task, args.size, args.seed, nproc) == (mode, task, size, seed, ranks)
    assert Path(args.mode).is_file()  # found from the checkout whatever the working directory
    assert (args.offset_cond, args.offset_uncond) == (298, 9)
    assert args.cond_kv == kv / "to_x2v_cond_kv_0_298.pt" and args.uncond_kv == kv / "to_x2v_uncond_kv_0_9.pt"
    # the mode file's sampling values: no override is passed
    assert (args.infer_steps, args.cfg_scale, args.cfg_interval, args.cfg_norm, args.timestep_shift,
            args.enable_cfg) == (None,) * 6
    assert str(args.output) == f"outputs/replay/{name.removeprefix('run_')}.png"


def test_launcher_overrides_and_errors(tmp_path):
    kv = touch(tmp_path / "kv", "to_x2v_cond_kv_325.pt", "to_x2v_uncond_kv_9.pt", "to_x2v_cond_kv_1_360.pt",
               "to_x2v_uncond_kv_1_12.pt")
    _, args = lx2v_parsed("run_neopp_moe_t2i_1k", KV_DIR=str(kv))
    assert (args.offset_cond, args.offset_uncond, args.cond_kv.name) == (325, 9, "to_x2v_cond_kv_325.pt")
    _, args = lx2v_parsed("run_neopp_moe_t2i_1k", KV_DIR=str(kv), TURN="1", OFFSET_COND="366", SEED="none",
                          SIZE="64 96", STEPS="2", OUTPUT="/out/x.png")
    assert (args.offset_cond, args.offset_uncond, args.cond_kv.name) == (366, 12, "to_x2v_cond_kv_1_360.pt")
    assert (args.seed, args.size, args.infer_steps, str(args.output)) == ("none", [64, 96], 2, "/out/x.png")
    with pytest.raises(InputError, match="no uncond dump for turn 2"):
        launcher_argv("run_neopp_moe_t2i_1k", {"KV_DIR": str(touch(kv, "to_x2v_cond_kv_2_5.pt")), "TURN": "2"})
    explicit = {"KV_DIR": str(kv), "COND_KV": "/kv/cond.pt", "UNCOND_KV": "/kv/uncond.pt"}
    with pytest.raises(InputError, match="cond.pt: not a LightLLM dump name"):
        launcher_argv("run_neopp_dense_t2i_1k", explicit)
    _, args = lx2v_parsed("run_neopp_dense_t2i_1k", **explicit, OFFSET_COND="298", OFFSET_UNCOND="9")
    assert (str(args.cond_kv), args.offset_cond, args.offset_uncond) == ("/kv/cond.pt", 298, 9)
    for bad, match in (({"TURN": "one"}, "TURN: expected"), ({"NPROC": "two"}, "NPROC: expected")):
        with pytest.raises(InputError, match=match):
            launcher_argv("run_neopp_dense_t2i_1k", {"KV_DIR": str(kv), **bad})


def test_cases_read_lightllm_names_but_keep_their_logged_offsets(tmp_path):
    names = ["to_x2v_cond_kv_0_298.pt", "to_x2v_uncond_kv_0_9.pt", "to_x2v_cond_kv_1_360.pt",
             "to_x2v_uncond_kv_1_12.pt", "to_x2v_cond_kv_2_439.pt", "to_x2v_uncond_kv_2_15.pt"]
    kv = touch(tmp_path / "kv", *names)
    _, _, turns = parsed("dense_3turn_2k", KV_DIR=str(kv))
    assert [t.cond.name for t in turns] == names[0::2] and [t.uncond.name for t in turns] == names[1::2]
    assert [(t.offset_cond, t.offset_uncond) for t in turns] == [(298, 9), (366, 12), (441, 15)]
    touch(kv, "turn1_cond.pt")  # the project's own name wins where both are present
    assert [t.cond.name for t in parsed("dense_3turn_2k", KV_DIR=str(kv))[2]][1] == "turn1_cond.pt"


def test_demo_case_runs_on_what_ships_from_any_directory(tmp_path):
    """`make replay CASE=demo` needs no variable: its script finds the checkout's demo model and
    sample KV from another directory, and its image is the one replay_kv draws from those files."""
    import os
    import subprocess
    import sys

    root = LAUNCHERS.parents[1]
    env = {k: v for k, v in os.environ.items() if k != "NEOPP_BASE_DIR"}
    env.update(PYTHON=sys.executable, OUT_DIR=str(tmp_path), STEPS="4")
    done = subprocess.run(["bash", str(LAUNCHERS / "demo.sh")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "neopp_dense: 256x256" in done.stdout and "seed=7 offsets=11/1" in done.stdout
    kv = root / "demo" / "checkpoints" / "dense" / "sample_kv"
    direct = tmp_path / "direct.png"
    assert replay_kv.main(["--checkpoint", str(root / "demo" / "checkpoints" / "dense"),
                           "--mode", str(root / "configs" / "neopp" / "neopp_dense.json"),
                           "--cond-kv", str(kv / "cond_kv.pt"), "--uncond-kv", str(kv / "uncond_kv.pt"),
                           "--offset-cond", "11", "--offset-uncond", "1", "--seed", "7", "--size", "256", "256",
                           "--steps", "4", "--cfg-norm", "global", "--output", str(direct)]) == 0
    assert (tmp_path / "demo_0.png").read_bytes() == direct.read_bytes()


def test_the_lora_folder_is_passed_only_where_it_exists(tmp_path: Path):
    """The default folder (checkpoints/lora under the checkout) is passed when it is there, never
    when it is not; a LORA_DIR the caller names is passed as named."""
    assert parsed("demo", NEOPP_BASE_DIR=str(tmp_path))[1].lora_dir is None
    (tmp_path / "checkpoints" / "lora").mkdir(parents=True)
    assert parsed("demo", NEOPP_BASE_DIR=str(tmp_path))[1].lora_dir == tmp_path / "checkpoints" / "lora"
    assert str(parsed("demo", NEOPP_BASE_DIR=str(tmp_path), LORA_DIR="elsewhere")[1].lora_dir) == "elsewhere"
