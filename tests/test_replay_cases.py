"""The replay case table: every launcher names a case, and a case's arguments parse as intended."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from neopp.errors import InputError
from neopp.tools import replay_kv_multiturn
from neopp.tools.replay_cases import CASES, case_argv, main

LAUNCHERS = Path(__file__).resolve().parents[1] / "scripts" / "replay"


def parsed(name: str, **env: str):
    """(process count, parsed flags, turns) exactly as replay_kv_multiturn will see them."""
    nproc, argv = case_argv(name, env)
    args = replay_kv_multiturn.build_parser().parse_args(argv)
    return nproc, args, [replay_kv_multiturn.parse_turn(t) for t in args.turn]


def test_each_launcher_runs_its_own_case_and_each_case_has_a_launcher():
    named = {}
    for script in LAUNCHERS.glob("*.sh"):
        found = re.findall(r"-m neopp\.tools\.replay_cases (\w+) ", script.read_text())
        assert found == [script.stem], script
        named[script.stem] = script
    assert set(named) == set(CASES)


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
    assert args.enable_cfg is False and args.cfg_scale == 1.0 and str(args.lora_dir) == "checkpoints/lora"
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
