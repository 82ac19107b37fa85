"""The GPU check's code path on CPU: every mode (4 ranks: CFG-parallel and CFG + Ulysses too) on
the 8B geometry cut to 2 layers, a quarter of the width and a 64x64 image."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

from bench.geometry import EIGHT_B, random_tower_tensors, tower_shapes
from bench.gpu_modes import CheckSpec, mode_runs
from neopp.model.checkpoint import check_shapes
from neopp.model.checkpoint_config import CheckpointConfig

REPO = Path(__file__).resolve().parents[1]


def test_smoke_run_covers_every_mode_and_parallel_pixels_agree() -> None:
    cmd = [
        sys.executable,
        "-m",
        "bench.gpu_check",
        "--device",
        "cpu",
        "--devices",
        "4",
        "--layers",
        "2",
        "--shrink",
        "4",
        "--size",
        "64",
        "--steps",
        "2",
        "--lora-steps",
        "2",
        "--moe-steps",
        "2",
        "--moe-layers",
        "2",
        "--moe-experts",
        "4",
        "--prefix",
        "16",
        "--small-sizes",
        "64",
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for name in ("dense bf16", "fp8", "8-step LoRA", "MoE", "CFG-parallel x2", "CFG x2 + Ulysses x2"):
        assert any(line.startswith(name) and "ms/step" in line and "GiB" in line for line in lines), name
    for path, modes in (("eager", 4), ("graphs", 4), ("default", 4), ("compiled", 2)):
        assert sum(line.startswith(f"  {path} ") and "ms/step" in line for line in lines) == modes, path
    assert sum("byte-equal to eager" in line for line in lines) == 4
    assert any(line.startswith("  guided 64x64 step: eager") for line in lines)
    goals = lines[lines.index(next(line for line in lines if line.startswith("goals"))) + 2:][:5]
    assert [line.split()[0] for line in goals] == ["dense", "FP8", "MoE", "guided", "guided"]
    assert all(line.count("met") + line.count("MISSED") + line.count(" -") == 2 for line in goals), goals
    compared = [line for line in lines if "vs dense bf16 on one device" in line]
    assert len(compared) == 2 and all("PASS" in line for line in compared)


def test_mode_list_follows_the_device_count() -> None:
    names = lambda n: [r.name for r in mode_runs(CheckSpec(), n)]  # noqa: E731
    assert names(1) == ["dense bf16", "fp8", "8-step LoRA", "MoE"]
    assert names(2)[-1] == "CFG-parallel x2" and len(names(2)) == 5
    assert names(4)[-1] == "CFG x2 + Ulysses x2" and len(names(4)) == 6


def test_random_tower_has_the_real_8b_keys_and_shapes() -> None:
    cfg = CheckpointConfig.from_dict(EIGHT_B.config())
    shapes = tower_shapes(cfg)
    params = sum(torch.Size(s).numel() for s in shapes.values())
    assert 6.9e9 < params < 7.2e9  # the 8B model's generation tower
    assert sum(k.startswith("language_model.model.layers.35.") for k in shapes) == 13
    check_shapes(cfg, {k: torch.empty(s, device="meta") for k, s in shapes.items()})
    small = CheckpointConfig.from_dict(replace(EIGHT_B, layers=1, hidden=256).config())
    tensors = random_tower_tensors(small, "cpu", torch.bfloat16, mlp_width=64, head_width=64)
    check_shapes(small, tensors)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())


def test_batching_bench_runs_two_plain_instances(tmp_path: Path) -> None:
    """The continuous-batching section `make gpu-check` ends with, on the tiny tower on the CPU."""
    cmd = [sys.executable, "-m", "bench.continuous_batching", "--geometries", "tiny", "--sizes", "64",
           "--counts", "1,2", "--repeats", "1", "--steps", "2", "--two-instances", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split("|")[1:-1] for line in (tmp_path / "continuous_batching.md").read_text().splitlines()
            if line.startswith("| 64x64 |")]
    assert [r[1].strip() for r in rows] == ["1", "2"]
    for row in rows:  # sequential, batched and two-instance seconds are all measured (2 decimals)
        assert all(float(row[i]) >= 0 for i in (2, 3, 6)), row
