"""Which models `make serve` loads: the prompt side wherever a tokenizer is, and per profile.

A SenseNova-U1 checkpoint carries its own ``tokenizer.json`` and so gets ``neopp_prompt_encoder``
and ``neopp_t2i`` as the demo does; a checkpoint without one (KV from LightLLM) gets the
generation models alone, and a note saying why. Read from make's dry run, so nothing is started.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from testing import tiny_u1

REPO = Path(__file__).resolve().parents[1]
PROMPT_SIDE = {"neopp_prompt_encoder", "neopp_t2i"}


def fresh_stamp(folder: Path) -> str:
    """A setup stamp newer than what setup depends on, so make never runs the install."""
    stamp = folder / "installed"
    stamp.touch()
    return f"STAMP={stamp}"


def served(checkpoint: Path, scratch: Path, *variables: str) -> tuple[set[str], str]:
    done = subprocess.run(["make", "-n", "serve", f"NEOPP_CHECKPOINT={checkpoint}", fresh_stamp(scratch), *variables],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return set(re.findall(r"--load-model=(\w+)", done.stdout)), done.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_a_u1_checkpoint_is_served_with_its_prompt_encoder(tmp_path):
    models, _ = served(tiny_u1.write_tiny_u1_checkpoint(tmp_path / "u1", seed=1), tmp_path)
    assert PROMPT_SIDE <= models and "neopp_dense" in models
    (tmp_path / "u1" / "tokenizer.json").unlink()
    models, text = served(tmp_path / "u1", tmp_path)
    assert not PROMPT_SIDE & models and "neopp_dense" in models
    assert "has no tokenizer.json:" in text and "neopp_prompt_encoder and neopp_t2i are not loaded" in text


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_small_profile_serves_one_mode_and_the_prompt_side(tmp_path):
    demo = REPO / "demo" / "checkpoints" / "dense"
    small, _ = served(demo, tmp_path, "PROFILE=small")
    assert small == {"neopp_dense", "neopp_dense_stream", *PROMPT_SIDE}
    full, _ = served(demo, tmp_path)
    assert small < full and {"neopp_moe", "neopp_dense_cfg_seq", "neopp_session"} <= full
    done = subprocess.run(["make", "serve", "PROFILE=tiny", fresh_stamp(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "PROFILE=tiny: expected full or small" in done.stderr
