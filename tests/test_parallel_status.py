"""The CFG-parallel / sequence-parallel status of a request: every reason, the log line, the replay output."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from neopp.modes import load_mode
from neopp.parallel import split_status as ps
from neopp.request import GenerationRequest
from neopp.sampling.plan import StepPlan
from neopp.serving.request_log import request_line
from neopp.tools import replay_kv, replay_kv_multiturn
from testing.tiny_checkpoint import write_sample_kv, write_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
MODES = {name: load_mode(REPO / "configs" / "neopp" / f"{name}.json") for name in
         ("neopp_dense", "neopp_dense_8steps", "neopp_dense_parallel_cfg", "neopp_dense_parallel_cfg_seq")}
CFG = MODES["neopp_dense_parallel_cfg"]
# 4 steps at shift 3 start at t = 0, 0.1, 0.25, 0.5
FOUR = {"infer_steps": 4, "timestep_shift": 3.0}
PARTIAL = "cfg_parallel=partial(steps={}/4,reason=steps_outside_cfg_interval)"
OFF_ONE_SEQ = "seq_parallel=off(reason=one_seq_rank)"


def status(mode, has_uncond=True, **sampling):
    s = mode.sampling_params.replace(**sampling)
    return ps.parallel_status(mode, s, has_uncond, list(StepPlan.of(s).guided_steps))


@pytest.mark.parametrize("mode,has_uncond,sampling,field", [
    # every step guided on a 2-rank mode
    (CFG, True, FOUR, "cfg_parallel=on"),
    # some steps outside cfg_interval: active on 2 of 4
    (CFG, True, dict(FOUR, cfg_interval=(0.2, 0.6)), PARTIAL.format(2)),
    (CFG, True, dict(FOUR, cfg_interval=(0.0, 0.05)), PARTIAL.format(1)),
    # the mode has one CFG rank (guidance still runs, on one device)
    (MODES["neopp_dense"], True, FOUR, "cfg_parallel=off(reason=one_cfg_rank)"),
    # the 8-step LoRA mode file turns guidance off (it also has one rank: the mode's own choice is named)
    (MODES["neopp_dense_8steps"], False, {}, "cfg_parallel=off(reason=guidance_off_in_mode)"),
    # ... and a replay flag turning it back on leaves the one-rank reason
    (MODES["neopp_dense_8steps"], True, {"enable_cfg": True}, "cfg_parallel=off(reason=one_cfg_rank)"),
    # guidance turned off for this call (replay --no-cfg, the runner's enable_cfg=False)
    (CFG, True, dict(FOUR, enable_cfg=False), "cfg_parallel=off(reason=guidance_off_by_override)"),
    (CFG, True, dict(FOUR, cfg_scale=1.0), "cfg_parallel=off(reason=cfg_scale<=1)"),
    (CFG, False, dict(FOUR, cfg_scale=0.5), "cfg_parallel=off(reason=cfg_scale<=1)"),
    (CFG, False, dict(FOUR, cfg_interval=(0.7, 0.9)), "cfg_parallel=off(reason=no_uncond_kv)"),
    (CFG, False, FOUR, "cfg_parallel=off(reason=no_uncond_kv)"),  # the server refuses this one before the log
    (CFG, True, dict(FOUR, cfg_interval=(0.7, 0.9)), "cfg_parallel=off(reason=no_step_in_cfg_interval)"),
])
def test_every_cfg_reason(mode, has_uncond, sampling, field):
    assert status(mode, has_uncond, **sampling).cfg_field == field


def test_sequence_parallel_field():
    assert status(MODES["neopp_dense_parallel_cfg_seq"]).seq_field == "seq_parallel=on(ranks=2)"
    assert status(MODES["neopp_dense_parallel_cfg_seq"]).cfg_field == "cfg_parallel=on"
    for name in ("neopp_dense", "neopp_dense_parallel_cfg", "neopp_dense_8steps"):
        assert status(MODES[name]).seq_field == OFF_ONE_SEQ


def test_status_keeps_the_counts():
    st = status(CFG, **dict(FOUR, cfg_interval=(0.2, 0.6)))
    assert (st.cfg_state, st.guided_steps, st.steps, st.seq_ranks) == ("partial", 2, 4, 1)
    one_rank = status(MODES["neopp_dense"], **FOUR)
    assert (one_rank.cfg_state, one_rank.guided_steps) == ("off", 4)  # guided, on one device


def test_rules_are_ordered_and_each_reason_is_reachable():
    """A new guidance branch adds a rule; each existing one must stay reachable (tested above)."""
    names = [name for name, _ in ps.CFG_OFF_RULES]
    assert names == [ps.GUIDANCE_OFF_IN_MODE, ps.ONE_CFG_RANK, ps.GUIDANCE_OFF_BY_OVERRIDE, ps.CFG_SCALE_AT_MOST_1,
                     ps.NO_UNCOND_KV, ps.NO_STEP_IN_INTERVAL]


def test_troubleshooting_doc_names_every_reason():
    text = (REPO / "docs" / "troubleshooting.md").read_text()
    reasons = [name for name, _ in ps.CFG_OFF_RULES] + [ps.STEPS_OUTSIDE_INTERVAL, ps.ONE_SEQ_RANK]
    for reason in reasons:
        assert f"reason={reason}" in text, reason
    assert "(docs/troubleshooting.md)" in (REPO / "README.md").read_text()


# --------------------------------------------------------------------------- the log line

LINE = re.compile(r"^(?P<name>\S+): (?P<h>\d+)x(?P<w>\d+) task=t2i prefix=(?P<sc>\d+)\+(?P<su>\d+) tokens "
                  r"steps=(?P<steps>\d+) png (?P<bytes>\d+) B e2e_time_ms=(?P<ms>\d+) "
                  r"(?P<cfg>cfg_parallel=\S+) (?P<seq>seq_parallel=\S+)")


def test_request_line_fields():
    kv = torch.zeros(2, 2, 30, 2, 32)
    req = GenerationRequest(cond_kv=kv, index_offset_cond=30, height=64, width=96, uncond_kv=kv[:, :, :5],
                            index_offset_uncond=5,
                            sampling_params=CFG.sampling_params.replace(output_format="png", **FOUR))
    line = request_line("neopp_dense_cfg", CFG, req, 1234, 0.0876)
    m = LINE.match(line)
    assert m, line
    assert m.groupdict() == {"name": "neopp_dense_cfg", "h": "64", "w": "96", "sc": "30", "su": "5", "steps": "4",
                             "bytes": "1234", "ms": "88", "cfg": "cfg_parallel=on",
                             "seq": OFF_ONE_SEQ}
    no_uncond = GenerationRequest(cond_kv=kv, index_offset_cond=30, height=64, width=96,
                                  sampling_params=CFG.sampling_params.replace(output_format="png", cfg_scale=1.0))
    line = request_line("neopp_dense_cfg", CFG, no_uncond, 10, 2.0)
    assert "prefix=30+0 tokens" in line and "e2e_time_ms=2000 cfg_parallel=off(reason=cfg_scale<=1)" in line


# --------------------------------------------------------------------------- the replay tools

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("status") / "dense", "dense")
    write_sample_kv(path / "kv", "dense")
    return path


def replay_lines(capsys) -> list[re.Match]:
    out = capsys.readouterr().out.splitlines()
    matches = [LINE.match(line) for line in out]
    assert all(matches), out
    return matches


def test_replay_kv_prints_the_line(ckpt, tmp_path, capsys):
    mode = REPO / "configs" / "neopp" / "neopp_dense.json"
    argv = ["--checkpoint", str(ckpt), "--mode", str(mode), "--size", "64", "64", "--steps", "2",
            "--cond-kv", str(ckpt / "kv" / "cond_kv.pt"), "--offset-cond", "24", "--seed", "3"]
    assert replay_kv.main(argv + ["--uncond-kv", str(ckpt / "kv" / "uncond_kv.pt"), "--offset-uncond", "7",
                                  "--output", str(tmp_path / "a.png")]) == 0
    assert replay_kv.main(argv + ["--no-cfg", "--output", str(tmp_path / "b.png")]) == 0
    a, b = replay_lines(capsys)
    assert (a["name"], a["sc"], a["su"], a["steps"]) == ("neopp_dense", "24", "7", "2")
    assert (b["sc"], b["su"]) == ("24", "0")
    assert int(a["bytes"]) == (tmp_path / "a.png").stat().st_size
    for m in (a, b):  # a one-rank mode names that first, whether guidance ran (a) or not (b)
        assert m["cfg"] == "cfg_parallel=off(reason=one_cfg_rank)" and m["seq"] == OFF_ONE_SEQ


def test_replay_multiturn_prints_one_line_per_image(ckpt, tmp_path, capsys):
    mode = REPO / "configs" / "neopp" / "neopp_dense.json"
    turn = f"{ckpt / 'kv' / 'cond_kv.pt'},{ckpt / 'kv' / 'uncond_kv.pt'},24,7"
    argv = ["--checkpoint", str(ckpt), "--mode", str(mode), "--size", "64", "64", "--steps", "2",
            "--output-dir", str(tmp_path), "--turn", turn + ",5", "--turn", turn + ",none"]
    assert replay_kv_multiturn.main(argv) == 0
    lines = replay_lines(capsys)
    assert len(lines) == 2
    assert lines[0].string.endswith(f"output={tmp_path / 'turn_0.png'} seed=5 offsets=24/7")
    assert lines[1].string.endswith("seed=continued offsets=24/7")
