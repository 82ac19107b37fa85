"""The SenseNova checkpoints docs/checkpoints.md lists as served unchanged, each claim on a tiny checkpoint
of that shape: the 8B MoT family (dense generation tower), the A3B MoE family, U1.5 (ConvDecoder
pixel head, noise scale capped at 16, generation branch stored in float32). Each tiny checkpoint
is written in the real key layout with the shape's config.json fields, loaded by the serving
loader, and its velocity checked against the float64 reference, which reads the same files on its
own. Tolerance VEL_RTOL: that of test_reference_equivalence and test_checkpoint_fidelity (float32
runner against float64 reference, argued there). Its table names a shape tested here for
every row, or says "untested".
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from neopp.modes import ModeSpec, SamplingParams
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from neopp.sampling.schedule import initial_noise_scale
from testing import REPO
from testing.probes import branch_velocity
from testing.tiny_checkpoint import random_kv, tiny_config, write_tiny_checkpoint
from tests.reference import neopp_reference as ref

VEL_RTOL = 5e-6
H, W = 64, 96  # 2 x 3 tokens of 32 pixels
TOKENS = (H // 32) * (W // 32)
# U1.5: the pixel head, a noise scale that reaches past the usual cap of 8 (40 * sqrt(6 / 64) =
# 12.2 at this size) under a cap of 16, and the generation branch stored in float32.
SHAPES = {
    "8B MoT": ("dense", {}, False),
    "A3B MoT (MoE)": ("moe", {}, False),
    "U1.5 8B MoT": ("pixel", {"noise_scale_mode": "resolution", "noise_scale": 40.0,
                              "noise_scale_max_value": 16.0}, True),
}

pytestmark = pytest.mark.usefixtures("one_thread")


def _generation_branch(key: str) -> bool:
    return "mot_gen" in key or key.startswith("fm_modules.")


def write_shape(root: Path, name: str) -> Path:
    variant, overrides, f32 = SHAPES[name]
    path = write_tiny_checkpoint(root / re.sub(r"\W+", "_", name), variant, seed=0, overrides=overrides)
    if f32:  # as released: the generation branch in float32, the rest as written
        file = path / "model.safetensors"
        tensors = load_file(str(file))
        save_file({k: v.float() if _generation_branch(k) else v for k, v in tensors.items()}, str(file))
    return path


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_shape_loads_unchanged_and_draws_as_the_reference(tmp_path: Path, name: str):
    path = write_shape(tmp_path, name)
    mode = ModeSpec(name="catalog", version=SHAPES[name][0], sampling_params=SamplingParams(infer_steps=2))
    pipe = NeoPPPipeline.from_pretrained(path, mode, device="cpu", dtype=torch.float32)
    model = ref.RefModel(path)
    cond = random_kv(tiny_config(SHAPES[name][0]), 9, 3, dtype=torch.float32)
    req = GenerationRequest(cond_kv=cond, index_offset_cond=20, height=H, width=W)
    x = NoiseStream(3).draw(H, W) * 1.3
    v_run = branch_velocity(pipe, req, x, 0.4, "cond").double()
    v_ref = ref.reference_velocity(model, cond, 20, x, 0.4, H, W)
    assert ((v_run - v_ref).abs().max() / v_ref.abs().max()).item() <= VEL_RTOL


def test_u1_5_s_noise_scale_reaches_past_8_up_to_16_and_its_float32_branch_serves_in_bf16(tmp_path: Path):
    path = write_shape(tmp_path, "U1.5 8B MoT")
    stored = load_file(str(path / "model.safetensors"))
    assert {v.dtype for k, v in stored.items() if _generation_branch(k)} == {torch.float32}
    mode = ModeSpec(name="catalog", version="pixel", sampling_params=SamplingParams(infer_steps=2))
    pipe = NeoPPPipeline.from_pretrained(path, mode, device="cpu", dtype=torch.float32)
    assert pipe.config.use_pixel_head and pipe.config.noise_scale_max_value == 16.0
    assert initial_noise_scale(pipe.config, TOKENS) == pytest.approx(40.0 * (TOKENS / 64) ** 0.5, rel=1e-12)
    assert initial_noise_scale(pipe.config, 4096) == 16.0  # 320 uncapped
    assert ref.noise_scale(ref.RefModel(path), TOKENS) == pytest.approx(initial_noise_scale(pipe.config, TOKENS))
    served = NeoPPPipeline.from_pretrained(path, mode, device="cpu", dtype=torch.bfloat16)  # as on a GPU
    assert {w.weight.dtype for w in served.transformer.linears()} == {torch.bfloat16}  # float32 on disk, not twice


def catalog_rows(text: str) -> list[list[str]]:
    """The rows of the checkpoint guide's table of SenseNova checkpoints (between its heading and the next)."""
    section = text.split("## SenseNova checkpoints this server loads unchanged", 1)[1].split("\n#", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row] for row in rows]


def test_every_checkpoint_the_guide_lists_names_a_shape_tested_here_or_says_untested():
    rows = catalog_rows((REPO / "docs" / "checkpoints.md").read_text())
    assert len(rows) >= 10, rows
    for row in rows:
        tested = row[-1]
        assert tested == "untested" or tested in {f"tiny {name}" for name in SHAPES} | {"tiny 8B MoT + LoRA"}, row
