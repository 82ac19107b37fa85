"""Checkpoints and LoRAs are deployment settings: the shipped 8-step model finds its LoRA through
``lora_dir`` (parameter or environment), and a LoRA made for another checkpoint is refused at load
naming the model, the file and the first key that does not fit. Real safetensors files throughout."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from google.protobuf import json_format, text_format
from safetensors import safe_open
from tritonclient.grpc import model_config_pb2 as mc

from neopp.errors import ConfigError
from neopp.model.checkpoint import generation_shapes
from neopp.model.lora import split_key
from neopp.serving.model_settings import PARAMETER_DEFAULTS, TritonModelSettings, load_model_mode, resolve_lora_dir
from neopp.serving.parameters import read_parameters
from testing import REPO
from testing.tiny_checkpoint import main as tiny_main
from testing.tiny_checkpoint import write_mismatched_loras

MODEL = "neopp_dense_8steps"
LORA = "neopp_8steps_lora.safetensors"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny dense checkpoint (``dense/``) and the LoRAs that fit it (``lora/``)."""
    out = tmp_path_factory.mktemp("deploy")
    tiny_main(["--out", str(out), "--variant", "dense"])
    return out


@pytest.fixture(scope="module")
def wide_lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mismatched_loras(tmp_path_factory.mktemp("wide_lora"))


def shipped_config(model: str) -> dict:
    """The model's config.pbtxt as the dict Triton hands the backend."""
    text = (REPO / "model_repository" / model / "config.pbtxt").read_text()
    return json_format.MessageToDict(text_format.Parse(text, mc.ModelConfig()), preserving_proto_field_name=True)


def settings_for(monkeypatch: pytest.MonkeyPatch, checkpoint: Path, lora_dir: Path) -> TritonModelSettings:
    """The shipped model's settings with the per-model environment overrides a deployer sets."""
    monkeypatch.setenv("NEOPP_CHECKPOINT_NEOPP_DENSE_8STEPS", str(checkpoint))
    monkeypatch.setenv("NEOPP_LORA_DIR_NEOPP_DENSE_8STEPS", str(lora_dir))
    return TritonModelSettings.from_config(shipped_config(MODEL), REPO / "model_repository" / MODEL)


def test_lora_dir_precedence(tmp_path: Path) -> None:
    params = read_parameters(shipped_config(MODEL), PARAMETER_DEFAULTS)
    assert resolve_lora_dir(params, MODEL, tmp_path, env={}) == tmp_path / params["lora_dir"]
    env = {"NEOPP_LORA_DIR": "/a", "NEOPP_LORA_DIR_NEOPP_DENSE_8STEPS": "/b"}
    assert resolve_lora_dir(params, MODEL, tmp_path, env=env) == Path("/b")
    assert resolve_lora_dir(params, "neopp_dense", tmp_path, env=env) == Path("/a")


def test_file_name_in_mode_file_resolves_in_lora_dir(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_for(monkeypatch, tiny / "dense", tiny / "lora")
    mode = load_model_mode(settings)
    assert [e["path"] for e in mode.lora_configs] == [str((tiny / "lora" / LORA).resolve())]
    assert mode.sampling_params.infer_steps == 8


def refusal(settings: TritonModelSettings) -> str:
    """The ConfigError loading ``settings``' mode ends with."""
    with pytest.raises(ConfigError) as err:
        load_model_mode(settings)
    return str(err.value)


def test_missing_lora_names_model_file_and_setting(tiny: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_for(monkeypatch, tiny / "dense", tmp_path)
    message = refusal(settings)
    for part in (MODEL, str(tmp_path / LORA), "NEOPP_LORA_DIR_NEOPP_DENSE_8STEPS", "lora_dir"):
        assert part in message


def first_misfit_base(lora: Path, checkpoint: Path) -> str:
    """The first target (in file order) whose factors do not fit the checkpoint's weight."""
    shapes = generation_shapes(checkpoint)
    with safe_open(str(lora), framework="pt") as handle:
        for key in handle.keys():
            base, role, _ = split_key(key)
            weight = shapes[base + ".weight"].shape
            shape = handle.get_slice(key).get_shape()
            if (role == "up" and shape[0] != weight[0]) or (role == "down" and shape[1] != weight[1]):
                return base
    raise AssertionError("every key fits")


def test_lora_for_other_geometry_refused_naming_model_file_and_key(tiny: Path, wide_lora_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_for(monkeypatch, tiny / "dense", wide_lora_dir)
    message = refusal(settings)
    assert message.startswith(f"model {MODEL}: ") and str(wide_lora_dir / LORA) in message
    key = re.search(r"key '([^']+)'", message).group(1)
    assert split_key(key)[0] == first_misfit_base(wide_lora_dir / LORA, tiny / "dense")


def test_warmup_parameter_is_on_by_default_and_checked(monkeypatch: pytest.MonkeyPatch, tiny: Path) -> None:
    monkeypatch.setenv("NEOPP_CHECKPOINT", str(tiny / "dense"))
    config = shipped_config("neopp_dense")
    assert TritonModelSettings.from_config(config, REPO / "model_repository" / "neopp_dense").warmup is True
    config["parameters"]["warmup"] = {"string_value": "false"}
    assert TritonModelSettings.from_config(config, REPO / "model_repository" / "neopp_dense").warmup is False
    config["parameters"]["warmup"] = {"string_value": "sometimes"}
    with pytest.raises(ConfigError, match="parameter warmup: must be true or false"):
        TritonModelSettings.from_config(config, REPO / "model_repository" / "neopp_dense")


def test_warm_up_runs_the_default_size_and_leaves_the_engine_exact(tiny: Path) -> None:
    """The warm-up changes nothing a request sees: the same seeded request gives the same pixels."""
    import torch

    from neopp.engines.factory import build_engine
    from neopp.engines.spec import EngineSpec
    from neopp.engines.warmup import warm_up
    from neopp.model.kv_cache import load_kv_file
    from neopp.modes import load_mode
    from neopp.request import GenerationRequest
    from neopp.sampling.rng import NoiseStream

    mode = load_mode(REPO / "configs" / "neopp" / "neopp_dense.json")
    mode = dataclasses.replace(mode, default_size=(64, 96))  # a small default for speed

    def seeded(engine) -> torch.Tensor:
        kv = tiny / "dense" / "sample_kv"
        req = GenerationRequest(cond_kv=load_kv_file(kv / "cond_kv.pt"), uncond_kv=load_kv_file(kv / "uncond_kv.pt"),
                                index_offset_cond=24, index_offset_uncond=7, height=64, width=64,
                                sampling_params=mode.sampling_params.replace(infer_steps=2))
        req.noise = NoiseStream(5).draw(64, 64)
        return torch.as_tensor(engine.generate(req))

    spec = EngineSpec.local(tiny / "dense", mode, "cpu", threads=1)
    cold = seeded(build_engine(spec))
    engine = build_engine(spec)
    assert warm_up(engine, mode) > 0
    assert torch.equal(seeded(engine), cold)
