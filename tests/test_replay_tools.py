"""replay_kv / replay_kv_multiturn without a server: stream rules, KV layouts, flags, torchrun.

The launcher scripts are run end to end in test_replay_launchers.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from neopp.model.kv_cache import load_kv_file
from neopp.runner import InProcessRunner
from neopp.tools import replay_kv, replay_kv_multiturn
from testing.tiny_checkpoint import tiny_config, tiny_tensors, write_sample_kv, write_tiny_checkpoint
from testing.tiny_lora import write_tiny_loras

REPO = Path(__file__).resolve().parents[1]
DENSE_MODE = REPO / "configs" / "neopp" / "neopp_dense.json"
CFG_MODE = REPO / "configs" / "neopp" / "neopp_dense_parallel_cfg.json"
STEPS8_MODE = REPO / "configs" / "neopp" / "neopp_dense_8steps.json"
FAST = ["--size", "64", "64", "--steps", "2"]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("replay") / "dense", "dense")
    write_sample_kv(path / "kv", "dense")
    return path


def common(ckpt: Path, mode: Path = DENSE_MODE) -> list[str]:
    return ["--checkpoint", str(ckpt), "--mode", str(mode), *FAST]


def turn_spec(ckpt: Path, seed: str, cond: str = "cond_kv.pt", uncond: str = "uncond_kv.pt") -> str:
    return f"{ckpt / 'kv' / cond},{ckpt / 'kv' / uncond},24,7,{seed}"


def test_multiturn_equals_runner_and_chained_single_replays(ckpt, tmp_path):
    argv = common(ckpt) + ["--output-dir", str(tmp_path / "multi")]
    for seed in ("200", "none", "none"):
        argv += ["--turn", turn_spec(ckpt, seed)]
    assert replay_kv_multiturn.main(argv) == 0
    multi = [(tmp_path / "multi" / f"turn_{i}.png").read_bytes() for i in range(3)]
    assert len(set(multi)) == 3

    runner = InProcessRunner(ckpt, DENSE_MODE)
    runner.load_kvcache(ckpt / "kv" / "cond_kv.pt", ckpt / "kv" / "uncond_kv.pt")
    direct = []
    for seed in (200, None, None):
        runner.set_inference_params(24, 7, infer_steps=2, output_format="png")
        direct.append(runner.generate(seed=seed, size=(64, 64)))
    assert direct == multi

    state = tmp_path / "stream.bin"
    single = []
    for i, seed in enumerate(("200", None, None)):
        out = tmp_path / f"single_{i}.png"
        argv = common(ckpt) + ["--cond-kv", str(ckpt / "kv" / "cond_kv.pt"),
                               "--uncond-kv", str(ckpt / "kv" / "uncond_kv.pt"), "--offset-cond", "24",
                               "--offset-uncond", "7", "--output", str(out), "--state-out", str(state)]
        argv += ["--seed", seed] if seed else ["--state-in", str(state)]
        assert replay_kv.main(argv) == 0
        single.append(out.read_bytes())
    assert single == multi


def test_turns_from_json_equal_turns_from_flags_and_layouts_agree(ckpt, tmp_path):
    kv = ckpt / "kv"
    spec = {"turns": [{"cond": str(kv / "cond_kv.replay.safetensors"),
                       "uncond": str(kv / "uncond_kv.replay.safetensors"),
                       "offset_cond": 24, "offset_uncond": 7, "seed": 5},
                      {"cond": "kv/cond_kv.online.safetensors", "uncond": "kv/uncond_kv.online.safetensors",
                       "offset_cond": 24, "offset_uncond": 7}]}
    (ckpt / "turns.json").write_text(json.dumps(spec))  # relative paths resolve against the JSON file
    assert replay_kv_multiturn.main(common(ckpt) + ["--turns", str(ckpt / "turns.json"),
                                                    "--output-dir", str(tmp_path / "json")]) == 0
    flags = common(ckpt) + ["--output-dir", str(tmp_path / "flags"), "--turn", turn_spec(ckpt, "5"),
                            "--turn", turn_spec(ckpt, "none")]
    assert replay_kv_multiturn.main(flags) == 0
    for i in range(2):
        assert (tmp_path / "json" / f"turn_{i}.png").read_bytes() == (tmp_path / "flags" / f"turn_{i}.png").read_bytes()


def test_a_flag_overrides_the_mode_value(ckpt, tmp_path):
    base = common(ckpt) + ["--cond-kv", str(ckpt / "kv" / "cond_kv.pt"),
                           "--uncond-kv", str(ckpt / "kv" / "uncond_kv.pt"), "--offset-cond", "24",
                           "--offset-uncond", "7", "--seed", "3"]
    outs = {}
    for name, extra in (("mode", []), ("norm", ["--cfg-norm", "none"]), ("scale", ["--cfg-scale", "2.0"])):
        outs[name] = tmp_path / f"{name}.png"
        assert replay_kv.main(base + extra + ["--output", str(outs[name])]) == 0
    data = {k: v.read_bytes() for k, v in outs.items()}
    assert len(set(data.values())) == 3
    # CFG off needs no uncond prefix at all
    assert replay_kv.main(common(ckpt) + ["--cond-kv", str(ckpt / "kv" / "cond_kv.pt"), "--offset-cond", "24",
                                          "--seed", "3", "--no-cfg", "--output", str(tmp_path / "nocfg.png")]) == 0


def test_image_editing_replay_equals_the_runner_and_refuses_without_the_image_branch(ckpt, tmp_path, capsys):
    image_kv = write_sample_kv(tmp_path / "img", "dense", cond_tokens=15, seed=7)["cond_pt"]
    kv = ckpt / "kv"
    base = common(ckpt) + ["--cond-kv", str(kv / "cond_kv.pt"), "--uncond-kv", str(kv / "uncond_kv.pt"),
                           "--offset-cond", "24", "--offset-uncond", "7", "--seed", "3",
                           "--image-guidance-scale", "2"]
    out = tmp_path / "edit.png"
    assert replay_kv.main(base + ["--image-kv", str(image_kv), "--offset-image", "15", "--output", str(out)]) == 0
    runner = InProcessRunner(ckpt, DENSE_MODE)
    runner.set_kvcache_i2i(*(load_kv_file(p) for p in (kv / "cond_kv.pt", kv / "uncond_kv.pt", image_kv)))
    runner.set_inference_params(24, 7, infer_steps=2, output_format="png", image_guidance_scale=2.0,
                                index_offset_image=15)
    assert runner.generate(seed=3, size=(64, 64)) == out.read_bytes()
    capsys.readouterr()
    assert replay_kv.main(base + ["--output", str(tmp_path / "x.png")]) == 2
    assert "error: --image-guidance-scale: 2 refused without the image branch" in capsys.readouterr().err


def test_8steps_mode_finds_its_lora_through_lora_dir(ckpt, tmp_path, capsys):
    """The 8-step mode file names only its LoRA file; --lora-dir says where it is."""
    loras = write_tiny_loras(tmp_path / "lora", tiny_tensors(tiny_config("dense"), 0))
    request = ["--cond-kv", str(ckpt / "kv" / "cond_kv.pt"), "--offset-cond", "24", "--seed", "3"]
    argv = common(ckpt, STEPS8_MODE) + request
    assert replay_kv.main(argv + ["--lora-dir", str(tmp_path / "lora"), "--output", str(tmp_path / "8.png")]) == 0
    assert replay_kv.main(common(ckpt) + request + ["--no-cfg", "--output", str(tmp_path / "d.png")]) == 0
    assert (tmp_path / "8.png").read_bytes() != (tmp_path / "d.png").read_bytes(), "the LoRA was merged"
    assert replay_kv.main(argv + ["--output", str(tmp_path / "x.png")]) == 2
    assert loras["neopp_8steps_lora"].name in capsys.readouterr().err


def test_a_refused_flag_value_names_the_flag(ckpt, tmp_path, capsys):
    # what a launcher's STEPS=-3 becomes; the message names the flag, not the internal field
    argv = ["--checkpoint", str(ckpt), "--mode", str(DENSE_MODE), "--size", "64", "64",
            "--cond-kv", str(ckpt / "kv" / "cond_kv.pt"), "--offset-cond", "24", "--seed", "1",
            "--output", str(tmp_path / "x.png")]
    for flag, value in (("--steps", "-3"), ("--cfg-scale", "nan"), ("--timestep-shift", "0")):
        capsys.readouterr()
        assert replay_kv.main(argv + [flag, value]) == 2
        assert capsys.readouterr().err.startswith(f"error: {flag}: "), flag


def test_errors_are_one_clear_line(ckpt, tmp_path, capsys):
    assert replay_kv_multiturn.main(common(ckpt) + ["--output-dir", str(tmp_path), "--turn", "only-a-path"]) == 2
    assert "OFFSET_COND" in capsys.readouterr().err
    assert replay_kv.main(common(ckpt) + ["--cond-kv", str(tmp_path / "missing.pt"), "--offset-cond", "1",
                                          "--seed", "1", "--output", str(tmp_path / "x.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    argv = common(ckpt, CFG_MODE) + ["--cond-kv", str(ckpt / "kv" / "cond_kv.pt"), "--offset-cond", "1",
                                     "--output", str(tmp_path / "x.png")]
    env_world = os.environ.pop("WORLD_SIZE", None)
    try:
        assert replay_kv.main(argv) == 2
    finally:
        if env_world is not None:
            os.environ["WORLD_SIZE"] = env_world
    assert "torchrun --standalone --nproc_per_node=2" in capsys.readouterr().err


def assert_close_images(a: Path, b: Path, levels: int = 2) -> None:
    """CFG-parallel equals sequential up to floating-point reassociation: a level or two."""
    pa, pb = (np.asarray(Image.open(p), dtype=np.int16) for p in (a, b))
    assert pa.shape == pb.shape
    diff = np.abs(pa - pb)
    assert diff.max() <= levels and diff.mean() < 0.05, (diff.max(), diff.mean())


def _torchrun(n: int, args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={n}", "-m",
                           "neopp.tools.replay_kv_multiturn", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_cfg_parallel_replay_under_torchrun_equals_one_process_and_checks_the_count(ckpt, tmp_path):
    turns = ["--turn", turn_spec(ckpt, "200"), "--turn", turn_spec(ckpt, "none")]
    assert replay_kv_multiturn.main(common(ckpt) + ["--output-dir", str(tmp_path / "one"), *turns]) == 0
    ok = _torchrun(2, common(ckpt, CFG_MODE) + ["--output-dir", str(tmp_path / "two"), *turns])
    assert ok.returncode == 0, ok.stderr[-3000:]
    for i in range(2):
        assert_close_images(tmp_path / "two" / f"turn_{i}.png", tmp_path / "one" / f"turn_{i}.png")
    lines = [line for line in ok.stdout.splitlines() if "e2e_time_ms=" in line]  # rank 0 only, one per image
    assert len(lines) == 2 and all("cfg_parallel=on seq_parallel=off(reason=one_seq_rank)" in ln for ln in lines)
    bad = _torchrun(3, common(ckpt, CFG_MODE) + ["--output-dir", str(tmp_path / "three"), *turns])
    assert bad.returncode != 0
    assert "must equal the product of the parallel sizes" in bad.stdout + bad.stderr
