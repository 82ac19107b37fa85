"""Every replay launcher run as a user runs it: `bash script`, no venv activated, LightLLM's dump names.

The tiny checkpoints of `build/tiny` (written here from the same generator when that folder is
missing), 64x64 images and 2 steps keep the fourteen runs (four of them two-rank torchrun jobs
on gloo) to about a minute of CPU time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from neopp.tools import replay_kv
from testing.tiny_checkpoint import tiny_config, tiny_tensors, write_sample_kv, write_tiny_checkpoint
from testing.tiny_lora import write_tiny_loras

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "build" / "tiny"
# LightX2V's dense dumps as LightLLM names them: the 2K chat's names say 360/439, its log 366/441.
DENSE_DUMPS = [("to_x2v_cond_kv_0_298.pt", "to_x2v_uncond_kv_0_9.pt"),
               ("to_x2v_cond_kv_1_360.pt", "to_x2v_uncond_kv_1_12.pt"),
               ("to_x2v_cond_kv_2_439.pt", "to_x2v_uncond_kv_2_15.pt")]
MOE_DUMPS = [("to_x2v_cond_kv_325.pt", "to_x2v_uncond_kv_9.pt")]  # one-turn MoE dumps name no turn


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """build/tiny when `make tiny` wrote it, else the same checkpoints (seed 0) in a temp folder."""
    if all((TINY / p).exists() for p in ("dense/config.json", "moe/config.json",
                                         "lora/neopp_8steps_lora.safetensors")):
        return TINY
    root = tmp_path_factory.mktemp("tiny")
    for variant in ("dense", "moe"):
        write_tiny_checkpoint(root / variant, variant)
    write_tiny_loras(root / "lora", tiny_tensors(tiny_config("dense"), 0))
    return root


def write_dumps(folder: Path, variant: str, names: list[tuple[str, str]]) -> Path:
    """A distinct random prefix pair per turn, saved under LightLLM's names."""
    for turn, (cond, uncond) in enumerate(names):
        paths = write_sample_kv(folder / "src", variant, seed=100 + 10 * turn)
        shutil.copy(paths["cond_pt"], folder / cond)
        shutil.copy(paths["uncond_pt"], folder / uncond)
    shutil.rmtree(folder / "src")
    return folder


def run_script(script: str, env: dict[str, str]) -> str:
    """Run scripts/<script> with bash from an unrelated directory; its stdout."""
    run = subprocess.run(["bash", str(REPO / "scripts" / script)], cwd=env["OUT_DIR"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{script}: {run.stderr[-3000:]}"
    return run.stdout


def user_env(ckpt: Path, kv: Path, out: Path, **extra: str) -> dict[str, str]:
    """A shell without the venv: no VIRTUAL_ENV, no venv on PATH, PYTHON unusable.

    PYTHON is this interpreter only in a checkout without `.venv` (the scripts' fallback).
    """
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    python = "/nonexistent/python" if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
    env.update(PATH="/usr/bin:/bin", PYTHON=python, CKPT=str(ckpt), KV_DIR=str(kv),
               OUT_DIR=str(out), SIZE="64 64", STEPS="2", OMP_NUM_THREADS="1", **extra)
    return env


def decoded(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (64, 64)
        return np.asarray(image.convert("RGB"), dtype=np.int16)


def assert_close(a: Path, b: Path, levels: int = 2) -> None:
    """CFG-parallel equals one process up to float32 reassociation: a level or two of 255.

    The same bound as the replay tools' torchrun test; a wrong branch or offset moves pixels by
    tens of levels. (Bytes are not equal: the ranks add the two branches in another order.)
    """
    diff = np.abs(decoded(a) - decoded(b))
    assert diff.max() <= levels and diff.mean() < 0.05, (diff.max(), diff.mean())


def test_dense_launchers(tiny, tmp_path):
    kv = write_dumps(tmp_path / "kv", "dense", DENSE_DUMPS)
    out = tmp_path / "out"
    env = user_env(tiny / "dense", kv, out, LORA_DIR=str(tiny / "lora"))
    for script in ("run_neopp_dense_t2i_1k", "run_neopp_dense_i2i_1k", "run_neopp_dense_t2i_1k_cfg2"):
        run_script(f"lightx2v/{script}.sh", env)
    logs = {name: run_script(f"replay/{name}.sh", env) for name in (
        "dense_t2i_1k", "dense_i2i_1k", "dense_cfg_parallel_1k", "dense_3turn_2k", "dense_8steps_lora_2k")}

    # the offsets came from the names: a replay_kv run told them explicitly gives the same bytes
    direct = tmp_path / "direct.png"
    assert replay_kv.main(["--checkpoint", str(tiny / "dense"), "--mode", str(REPO / "configs/neopp/neopp_dense.json"),
                           "--cond-kv", str(kv / DENSE_DUMPS[0][0]), "--uncond-kv", str(kv / DENSE_DUMPS[0][1]),
                           "--offset-cond", "298", "--offset-uncond", "9", "--seed", "200", "--size", "64", "64",
                           "--steps", "2", "--output", str(direct)]) == 0
    assert direct.read_bytes() == (out / "neopp_dense_t2i_1k.png").read_bytes()
    run_script("lightx2v/run_neopp_dense_t2i_1k.sh", dict(env, OFFSET_COND="297", OUTPUT=str(out / "297.png")))
    assert (out / "297.png").read_bytes() != direct.read_bytes(), "an explicit offset wins and matters"

    assert_close(out / "neopp_dense_t2i_1k_cfg2.png", out / "neopp_dense_t2i_1k.png")
    for i in range(3):
        assert_close(out / f"dense_cfg_parallel_1k_{i}.png", out / f"dense_t2i_1k_{i}.png")
    chat = [decoded(out / f"dense_3turn_2k_{i}.png") for i in range(3)]
    assert len({c.tobytes() for c in chat}) == 3
    assert "offsets=366/12" in logs["dense_3turn_2k"] and "offsets=441/15" in logs["dense_3turn_2k"]
    for path in ("neopp_dense_i2i_1k.png", "dense_i2i_1k_0.png", "dense_8steps_lora_2k_0.png"):
        decoded(out / path)


def test_moe_launchers(tiny, tmp_path):
    kv = write_dumps(tmp_path / "kv", "moe", MOE_DUMPS)
    out = tmp_path / "out"
    env = user_env(tiny / "moe", kv, out)
    for script in ("run_neopp_moe_t2i_1k", "run_neopp_moe_t2i_1k_cfg2", "run_neopp_moe_t2i_512"):
        assert "offsets=325/9" in run_script(f"lightx2v/{script}.sh", env)
    for name in ("moe_t2i_1k", "moe_cfg_parallel_1k", "moe_512"):
        run_script(f"replay/{name}.sh", env)
    assert_close(out / "neopp_moe_t2i_1k_cfg2.png", out / "neopp_moe_t2i_1k.png")
    assert_close(out / "moe_cfg_parallel_1k_0.png", out / "moe_t2i_1k_0.png")
    # the 512 and 1K launchers differ only in their size, which SIZE overrides here
    assert (out / "neopp_moe_t2i_512.png").read_bytes() == (out / "neopp_moe_t2i_1k.png").read_bytes()
    assert (out / "moe_512_0.png").read_bytes() == (out / "moe_t2i_1k_0.png").read_bytes()


def test_without_neopp_the_scripts_say_what_to_do(tmp_path):
    """A copy of the scripts outside any checkout: no .venv, and neither PYTHON nor python3 has neopp."""
    shutil.copytree(REPO / "scripts", tmp_path / "scripts")
    bare = tmp_path / "bin" / "python3"  # a Python without site-packages, so without neopp
    bare.parent.mkdir()
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S -I "$@"\n')
    bare.chmod(0o755)
    env = {"PATH": f"{bare.parent}:/usr/bin:/bin", "PYTHON": str(bare)}
    for script in ("lightx2v/run_neopp_dense_t2i_1k.sh", "replay/dense_t2i_1k.sh"):
        run = subprocess.run(["bash", str(tmp_path / "scripts" / script)], env=env, capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 2
        assert "no Python with the neopp package" in run.stderr and "make setup" in run.stderr
