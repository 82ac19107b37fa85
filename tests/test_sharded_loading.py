"""The loader on a sharded checkpoint: memory-mapped, exact, dtype-preserving, strict about bad shards."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bench.geometry import (
    random_tensor,
    tower_shapes,
    with_understanding_keys,
    write_safetensors,
    write_sharded_checkpoint,
)
from neopp.errors import ConfigError
from neopp.model.checkpoint import is_generation_key, load_checkpoint, read_generation_tensors
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.sampling.pipeline import NeoPPPipeline
from testing.tiny_checkpoint import tiny_config

MLP, HEAD = 256, 256


def _write(tmp_path: Path, shards: int = 3) -> tuple[Path, CheckpointConfig, int]:
    raw = tiny_config("dense")
    cfg = CheckpointConfig.from_dict(raw)
    total = sum(math.prod(s) * 2 for s in tower_shapes(cfg, MLP, HEAD).values())
    written = write_sharded_checkpoint(tmp_path / "ckpt", raw, max_shard_bytes=total // shards + 1,
                                       mlp_width=MLP, head_width=HEAD)
    return tmp_path / "ckpt", cfg, written


def _mapped_files() -> set[str]:
    lines = Path("/proc/self/maps").read_text().splitlines()
    return {line.split()[-1] for line in lines if len(line.split()) > 5}


def test_three_shards_load_exactly_what_was_written(tmp_path: Path) -> None:
    ckpt, cfg, written = _write(tmp_path)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3 and index["metadata"]["total_size"] == written
    tensors = read_generation_tensors(ckpt)
    shapes = tower_shapes(cfg, MLP, HEAD)
    assert set(tensors) == set(shapes)  # the understanding tower's keys are skipped
    assert any(not is_generation_key(k) for k in index["weight_map"])
    for key, shape in shapes.items():
        assert tensors[key].dtype == torch.bfloat16 and tuple(tensors[key].shape) == shape
        assert torch.equal(tensors[key], random_tensor(key, shape)), key
    for shard in sorted(set(index["weight_map"].values())):  # the files read the same with safetensors itself
        with safe_open(str(ckpt / shard), framework="pt") as handle:
            for key in handle.keys():
                if key in tensors:
                    assert torch.equal(handle.get_tensor(key), tensors[key]), key


def test_tensors_are_mapped_not_copied_and_writes_stay_private(tmp_path: Path) -> None:
    ckpt, _, _ = _write(tmp_path)
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    before = shard.read_bytes()
    tensors = read_generation_tensors(ckpt)
    assert str(shard) in _mapped_files()
    next(iter(tensors.values())).add_(1.0)  # copy-on-write: the file must not change
    assert shard.read_bytes() == before
    del tensors
    assert str(shard) not in _mapped_files()  # freeing the tensors unmaps their pages


def test_cpu_default_is_float32_and_bfloat16_keeps_the_map(tmp_path: Path) -> None:
    ckpt, _, _ = _write(tmp_path)
    pipe32 = NeoPPPipeline.from_pretrained(ckpt, device="cpu")
    w32 = pipe32.transformer.linears()[0].weight
    assert pipe32.dtype == torch.float32 and w32.dtype == torch.float32 and w32.untyped_storage().resizable()
    pipe16 = NeoPPPipeline.from_pretrained(ckpt, device="cpu", dtype=torch.bfloat16)
    weight = pipe16.transformer.linears()[0].weight
    assert weight.dtype == torch.bfloat16 and not weight.untyped_storage().resizable()  # a frombuffer view


def test_fp8_and_float32_dtypes_survive(tmp_path: Path) -> None:
    cfg = CheckpointConfig.from_dict(tiny_config("dense"))
    shapes = dict(list(tower_shapes(cfg, MLP, HEAD).items())[:6])
    for dtype in (torch.float8_e4m3fn, torch.float32):
        folder = tmp_path / str(dtype)
        folder.mkdir()
        write_safetensors(folder / "model.safetensors", shapes, lambda k, s: random_tensor(k, s), dtype)
        tensors = read_generation_tensors(folder)
        for key, shape in shapes.items():
            want = random_tensor(key, shape).to(dtype)
            assert tensors[key].dtype == dtype
            assert torch.equal(tensors[key].view(torch.uint8), want.view(torch.uint8)), key


def test_truncated_shard_names_the_tensor(tmp_path: Path) -> None:
    ckpt, _, _ = _write(tmp_path)
    shard = sorted(ckpt.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(ConfigError, match=r"tensor '.*' in model-00003-of-00003.safetensors .*truncated"):
        load_checkpoint(ckpt)


def test_index_naming_the_wrong_shard_is_refused(tmp_path: Path) -> None:
    ckpt, _, _ = _write(tmp_path)
    path = ckpt / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    key = next(k for k in index["weight_map"] if is_generation_key(k))
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][key])
    index["weight_map"][key] = other
    path.write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=f"'{key}' in {other}"):
        load_checkpoint(ckpt)


def test_understanding_keys_are_added_per_layer() -> None:
    cfg = CheckpointConfig.from_dict(tiny_config("dense"))
    shapes = with_understanding_keys(cfg, tower_shapes(cfg, MLP, HEAD))
    extra = [k for k in shapes if not is_generation_key(k)]
    assert len(extra) == cfg.num_layers and all(k.endswith("input_layernorm.weight") for k in extra)
