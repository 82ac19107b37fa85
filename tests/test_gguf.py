"""GGUF checkpoints: block-quantized weights kept as bytes and dequantized per use.

The reference is the ``gguf`` package's own reader and dequantizer (``testing.tiny_gguf``), not
this project's code. Dequantization is exact arithmetic on float16 scales and small integers in
float32, in ggml's order, so the bar is equality: each block type reads bit for bit as the
reference reads it, and a checkpoint served from the GGUF file draws, on the CPU in float32, the
very image its dequantized weights draw from safetensors (also with a LoRA merged at load, and
with an adapter per request). Each refusal names the tensor and the rule.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from neopp.errors import ConfigError
from neopp.model.adapters import tower_linears
from neopp.model.checkpoint import load_checkpoint, stored_shapes
from neopp.model.gguf_blocks import BLOCK_TYPES, dequantize
from neopp.model.gguf_checkpoint import GGUFLinear
from neopp.modes import ModeSpec, SamplingParams
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing.tiny_checkpoint import random_kv, tiny_config, write_tiny_checkpoint
from testing.tiny_gguf import BLOCK_TYPES as WRITTEN
from testing.tiny_gguf import WIDE, dequantized_reference, write_gguf
from testing.tiny_lora import write_adapter, write_tiny_loras

SAMPLING = SamplingParams(infer_steps=3)
MODE = ModeSpec(name="gguf", sampling_params=SAMPLING)
H = W = 64


@pytest.mark.parametrize("kind", sorted(BLOCK_TYPES))
def test_each_block_type_reads_as_the_reference_reader_reads_it(kind):
    """Random bytes, scales included (their infinities and NaNs too): bit for bit, a NaN's
    payload aside."""
    block = BLOCK_TYPES[kind]
    raw = np.random.default_rng(1).integers(0, 256, size=(3, 2 * block.nbytes), dtype=np.uint8)
    want = quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
    got = dequantize(torch.from_numpy(raw), kind, (3, 2 * block.size)).numpy()
    nan = np.isnan(want)
    assert got.shape == want.shape and np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    dense = write_tiny_checkpoint(root / "dense", "dense", seed=2, overrides=WIDE)
    out = {}
    for kind in WRITTEN:
        file = write_gguf(dense, root / kind, kind, seed=3)
        out[kind] = file, dequantized_reference(file, root / f"{kind}_reference")
    return dense, out


def request(seed: int = 0, **fields) -> GenerationRequest:
    cfg = tiny_config("dense", WIDE)
    return GenerationRequest(cond_kv=random_kv(cfg, 12, 1), index_offset_cond=13, height=H, width=W,
                             noise=NoiseStream(seed).draw(H, W), sampling_params=SAMPLING,
                             uncond_kv=random_kv(cfg, 5, 2), index_offset_uncond=6, **fields)


def draw(checkpoint, mode: ModeSpec = MODE, **fields) -> torch.Tensor:
    pipe = NeoPPPipeline.from_pretrained(checkpoint, mode, "cpu", torch.float32)
    return pipe.sample(request(**fields))


@pytest.mark.parametrize("kind", WRITTEN)
def test_a_gguf_checkpoint_draws_the_image_of_its_dequantized_weights(checkpoints, kind):
    file, reference = checkpoints[1][kind]
    pipe = NeoPPPipeline.from_pretrained(file, MODE, "cpu", torch.float32)
    linears = pipe.transformer.linears()
    assert linears and all(isinstance(lin, GGUFLinear) and lin.weight.kind == kind for lin in linears)
    stored = sum(lin.nbytes() for lin in linears)
    assert stored < sum(lin.weight.numel() for lin in linears) * 4 * 0.3  # under 0.3 of float32
    got = pipe.sample(request())
    want = draw(reference)
    assert torch.isfinite(want).all() and want.abs().max() > 0
    assert torch.equal(got, want)


def test_a_lora_merged_at_load_and_an_adapter_per_request_match_the_float_checkpoint(checkpoints, tmp_path):
    file, reference = checkpoints[1]["Q4_K"]
    weights = {k: lin.weight for k, lin in tower_linears(
        NeoPPPipeline.from_pretrained(reference, MODE, "cpu", torch.float32).transformer).items()}
    merged = write_tiny_loras(tmp_path / "merged", weights)["neopp_8steps_lora"]
    eight = ModeSpec(name="eight", sampling_params=SAMPLING, lora_configs=({"path": str(merged), "strength": 1.0},))
    assert torch.equal(draw(file, eight), draw(reference, eight))
    write_adapter(tmp_path / "adapters", "attn", weights, sorted(k for k in weights if "q_proj" in k))
    images = []
    for checkpoint in (file, reference):
        pipe = NeoPPPipeline.from_pretrained(checkpoint, MODE, "cpu", torch.float32)
        pipe.use_adapter_dir(tmp_path / "adapters")
        images.append(pipe.sample(request(lora="attn", lora_scale=0.7)))
    assert torch.equal(*images) and not torch.equal(images[0], draw(reference))


def test_the_shapes_come_from_the_header_and_the_config_from_beside_the_file(checkpoints):
    dense, files = checkpoints
    file, _ = files["Q8_0"]
    config, tensors = load_checkpoint(file)
    assert config.hidden_size == 256 and set(stored_shapes(file)) == set(stored_shapes(dense))
    assert stored_shapes(file) == stored_shapes(dense)


def rewrite(source, out, edit) -> object:
    """A copy of a GGUF file with ``edit(name, array, type) -> (array, type) | None`` per tensor
    (None leaves the tensor out)."""
    reader = gguf.GGUFReader(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / "config.json").write_bytes((source.parent / "config.json").read_bytes())
    writer = gguf.GGUFWriter(str(out), arch="neopp")
    for tensor in reader.tensors:
        kept = edit(tensor.name, np.asarray(tensor.data), tensor.tensor_type)
        if kept is not None:
            data, qtype = kept
            writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


Q = "language_model.model.layers.0.self_attn.q_proj_mot_gen.weight"


def test_a_file_the_server_cannot_read_right_is_refused_naming_the_tensor(checkpoints, tmp_path):
    file, _ = checkpoints[1]["Q8_0"]
    q2 = gguf.GGMLQuantizationType.Q2_K

    def other_type(name, data, qtype):
        if name != Q:
            return data, qtype
        floats = quants.dequantize(data, qtype)
        size, nbytes = quants.GGML_QUANT_SIZES[q2]
        return np.zeros((floats.shape[0], floats.shape[1] // size * nbytes), np.uint8), q2

    cases = {
        "q2k": (lambda n, d, t: other_type(n, d, t), f"tensor '{Q}' is stored as Q2_K"),
        "missing": (lambda n, d, t: None if n == Q else (d, t), f"required tensor '{Q}' is missing"),
        "flat": (lambda n, d, t: (d.reshape(1, -1), t) if n == Q else (d, t), f"tensor '{Q}' has shape"),
    }
    for name, (edit, words) in cases.items():
        broken = rewrite(file, tmp_path / name / "model.gguf", edit)
        with pytest.raises(ConfigError, match=words):
            load_checkpoint(broken)
    cut = tmp_path / "cut" / "model.gguf"
    cut.parent.mkdir()
    (cut.parent / "config.json").write_bytes((file.parent / "config.json").read_bytes())
    cut.write_bytes(file.read_bytes()[: file.stat().st_size - 1000])
    with pytest.raises(ConfigError, match="model.gguf"):
        load_checkpoint(cut)
    wrong = tmp_path / "wrong" / "model.gguf"
    wrong.parent.mkdir()
    wrong.write_bytes(file.read_bytes())
    (wrong.parent / "config.json").write_text((checkpoints[0] / "config.json").read_text().replace("256", "128"))
    with pytest.raises(ConfigError, match="has shape"):
        load_checkpoint(wrong)


def test_fp8_on_a_gguf_checkpoint_is_refused_by_name(checkpoints):
    file, _ = checkpoints[1]["Q4_0"]
    fp8 = ModeSpec(name="fp8", sampling_params=SAMPLING, dit_quantized=True, dit_quant_scheme="fp8-sgl")
    with pytest.raises(ConfigError, match="mode fp8: FP8 quantisation of a GGUF checkpoint"):
        NeoPPPipeline.from_pretrained(file, fp8, "cpu", torch.float32)


def test_a_moe_checkpoint_s_experts_stay_in_blocks_and_draw_as_their_floats(tmp_path):
    moe = write_tiny_checkpoint(tmp_path / "moe", "moe", seed=4, overrides=WIDE)
    file = write_gguf(moe, tmp_path / "gguf", "Q4_K", seed=5)
    reference = dequantized_reference(file, tmp_path / "reference")
    mode = ModeSpec(name="moe", version="moe", sampling_params=SAMPLING)
    pipe = NeoPPPipeline.from_pretrained(file, mode, "cpu", torch.float32)
    experts = [k for k, lin in tower_linears(pipe.transformer).items() if ".experts." in k]
    assert experts and all(isinstance(tower_linears(pipe.transformer)[k], GGUFLinear) for k in experts)
    assert torch.equal(pipe.sample(request()), draw(reference, mode))


def test_the_benchmark_runs_and_reports_each_holding(tmp_path):
    from bench import gguf_weights

    gguf_weights.main(["--out", str(tmp_path), "--rounds", "1", "--tokens", "4", "--steps", "1"])
    report = (tmp_path / "gguf_weights.md").read_text()
    assert all(f"| {name} |" in report for name in ("float32", "Q8_0", "Q4_K", "Q4_0")) and " dB |" in report
