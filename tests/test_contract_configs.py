"""Every shipped config.pbtxt agrees with the contract's one table (neopp.contract.inputs).

The configs are parsed with Triton's own ModelConfig protobuf, so a field Triton would read
differently (a typo, a missing ``optional``) fails here, not at a user's first request.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from neopp.contract.inputs import (
    ENCODER_OUTPUTS,
    INPUT_SPECS,
    OUTPUT_SPECS,
    STREAM_INPUT_SPECS,
    STREAM_OUTPUT_SPECS,
    TensorSpec,
)
from neopp.modes import load_mode
from neopp.serving.model_io import T2I_PASSED_INPUTS as T2I_PASSED
from neopp.serving.model_io import generation_models
from neopp.tools import contract_configs
from testing import MODEL_REPOSITORY as REPO
from testing import REPO as ROOT

ALL_MODELS = sorted(p.parent.name for p in REPO.glob("*/config.pbtxt"))
STREAM_MODELS = [m for m in ALL_MODELS if m.endswith("_stream")]  # decoupled twins of plain models
BLS_AND_TEXT_MODELS = ("neopp_session", "neopp_t2i", "neopp_prompt_encoder")  # no generation inputs of their own
GENERATION_MODELS = [m for m in ALL_MODELS if m not in BLS_AND_TEXT_MODELS and m not in STREAM_MODELS]

# The session model takes the generation inputs except RNG_STATE and NOISE (it owns the stream), with the
# prefix inputs optional (a closing sequence_end carries none), plus MODEL and the owner's SESSION_TOKEN;
# it also returns TURN and SESSION_TOKEN.
SESSION_INPUTS = {
    **{n: TensorSpec(s.data_type, s.dims, optional=True) for n, s in INPUT_SPECS.items()
       if n not in ("RNG_STATE", "NOISE")},
    "MODEL": TensorSpec("TYPE_STRING", (1,)),
    "SESSION_TOKEN": TensorSpec("TYPE_STRING", (1,)),
}
SESSION_OUTPUTS = {"IMAGE": OUTPUT_SPECS["IMAGE"], "TURN": TensorSpec("TYPE_INT64", (1,)),
                   "NEXT_RNG_STATE": OUTPUT_SPECS["NEXT_RNG_STATE"],
                   "SESSION_TOKEN": TensorSpec("TYPE_STRING", (1,))}


def parse(model: str) -> mc.ModelConfig:
    return text_format.Parse((REPO / model / "config.pbtxt").read_text(), mc.ModelConfig())


def table(entries) -> dict[str, TensorSpec]:
    return {e.name: TensorSpec(mc.DataType.Name(e.data_type), tuple(e.dims), bool(getattr(e, "optional", False)))
            for e in entries}


def outputs_table(entries) -> dict[str, TensorSpec]:
    return {e.name: TensorSpec(mc.DataType.Name(e.data_type), tuple(e.dims)) for e in entries}


def params(cfg: mc.ModelConfig) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


def test_every_contract_model_is_shipped():
    assert GENERATION_MODELS == ["neopp_dense", "neopp_dense_8steps", "neopp_dense_cfg", "neopp_dense_cfg_seq",
                                 "neopp_dense_fp8", "neopp_moe", "neopp_moe_cfg"]
    assert STREAM_MODELS == ["neopp_dense_cfg_stream", "neopp_dense_stream"]


@pytest.mark.parametrize("model", GENERATION_MODELS)
def test_generation_config_matches_contract(model):
    cfg = parse(model)
    assert cfg.name == model and cfg.backend == "python"
    assert table(cfg.input) == INPUT_SPECS
    assert [e.name for e in cfg.input] == list(INPUT_SPECS), "inputs listed in the table's order"
    assert outputs_table(cfg.output) == {n: TensorSpec(s.data_type, s.dims) for n, s in OUTPUT_SPECS.items()}
    assert not cfg.model_transaction_policy.decoupled, "plain models answer once"


@pytest.mark.parametrize("model", STREAM_MODELS)
def test_stream_config_matches_contract_and_its_plain_twin(model):
    cfg, twin = parse(model), parse(model.removesuffix("_stream"))
    assert cfg.name == model and cfg.backend == "python" and cfg.model_transaction_policy.decoupled
    assert table(cfg.input) == STREAM_INPUT_SPECS
    assert [e.name for e in cfg.input] == list(STREAM_INPUT_SPECS), "inputs listed in the table's order"
    assert outputs_table(cfg.output) == {n: TensorSpec(s.data_type, s.dims) for n, s in STREAM_OUTPUT_SPECS.items()}
    # every input of the twin, the same way, except COND_KV: optional, as COND_KV_B64 may replace it
    mine, plain = table(cfg.input), table(twin.input)
    assert {n: s for n, s in mine.items() if n in plain and n != "COND_KV"} == \
        {n: s for n, s in plain.items() if n != "COND_KV"}
    assert mine["COND_KV"] == TensorSpec("TYPE_BF16", plain["COND_KV"].dims, optional=True)
    # a front of its plain twin's engine: the twin's settings (its limits apply), plus which model that is
    assert params(cfg) == {**params(twin), "engine_model": twin.name}
    assert cfg.max_batch_size == twin.max_batch_size == 0
    assert [(g.kind, g.count) for g in cfg.instance_group] == [(mc.ModelInstanceGroup.KIND_CPU, 1)]


def test_config_blocks_are_the_tables_written_out(tmp_path):
    """`make contract-configs` leaves nothing to write, and a hand edit is caught."""
    assert contract_configs.stale(REPO) == []
    copy = tmp_path / "model_repository"
    for path, _ in contract_configs.config_files(REPO):
        target = copy / path.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    (copy / "neopp_dense" / "1").mkdir(parents=True)
    (copy / "neopp_dense" / "1" / "model.py").write_text((REPO / "neopp_dense" / "1" / "model.py").read_text())
    edited = copy / "neopp_dense" / "config.pbtxt"
    seed = 'name: "SEED" data_type: TYPE_INT64'
    edited.write_text(edited.read_text().replace(seed, seed.replace("INT64", "INT32")))
    assert contract_configs.stale(copy) == [edited]


@pytest.mark.parametrize("model", GENERATION_MODELS + STREAM_MODELS)
def test_configs_do_not_restate_what_the_code_derives(model):
    """The process count comes from the mode file, the BLS allowlist from the repository."""
    assert "worker_processes" not in params(parse(model))
    assert load_mode(ROOT / params(parse(model))["mode_file"]).world_size >= 1


def test_session_config_matches_contract():
    cfg = parse("neopp_session")
    assert table(cfg.input) == SESSION_INPUTS
    assert outputs_table(cfg.output) == SESSION_OUTPUTS
    assert "allowed_models" not in params(cfg)
    assert list(generation_models(REPO)) == GENERATION_MODELS


def test_t2i_config_passes_generation_inputs_with_the_contract_s_types():
    cfg = parse("neopp_t2i")
    own = {"PROMPT": TensorSpec("TYPE_STRING", (1,), optional=False),
           "NEGATIVE_PROMPT": TensorSpec("TYPE_STRING", (1,)), "MODEL": TensorSpec("TYPE_STRING", (1,)),
           "THINK": TensorSpec("TYPE_BOOL", (1,)), "THINK_MAX_TOKENS": TensorSpec("TYPE_INT64", (1,)),
           "IMAGES": TensorSpec("TYPE_STRING", (-1,))}
    passed = {n: INPUT_SPECS[n] for n in T2I_PASSED}
    assert "IMAGE_GUIDANCE_SCALE" in passed
    assert table(cfg.input) == {**own, **passed}
    assert outputs_table(cfg.output) == {"IMAGE": OUTPUT_SPECS["IMAGE"],
                                         "THINK_TEXT": TensorSpec("TYPE_STRING", (1,))}
    assert "allowed_models" not in params(cfg)


def test_prompt_encoder_outputs_are_the_generation_models_prefix_inputs():
    cfg = parse("neopp_prompt_encoder")
    assert table(cfg.input) == {"PROMPT": TensorSpec("TYPE_STRING", (1,), optional=False),
                                "NEGATIVE_PROMPT": TensorSpec("TYPE_STRING", (1,)),
                                "THINK": TensorSpec("TYPE_BOOL", (1,)),
                                "THINK_MAX_TOKENS": TensorSpec("TYPE_INT64", (1,)),
                                "IMAGES": TensorSpec("TYPE_STRING", (-1,))}
    prefixes = (*ENCODER_OUTPUTS, "IMAGE_KV", "INDEX_OFFSET_IMAGE")  # an edit's image-only branch too
    assert outputs_table(cfg.output) == {**{n: TensorSpec(INPUT_SPECS[n].data_type, INPUT_SPECS[n].dims)
                                            for n in prefixes}, "THINK_TEXT": TensorSpec("TYPE_STRING", (1,))}


@pytest.mark.parametrize("model", GENERATION_MODELS)
def test_shipped_loras_are_file_names_found_through_lora_dir(model):
    """Where LoRAs live is a deployment setting: a shipped mode file names the file only."""
    p = params(parse(model))
    raw = json.loads((ROOT / p["mode_file"]).read_text())
    for entry in raw.get("lora_configs") or []:
        assert Path(entry["path"]).name == entry["path"], f"{p['mode_file']}: {entry['path']} is not a file name"
        assert "lora_dir" in p, f"{model}: its mode file names a LoRA, so config.pbtxt sets lora_dir"
    mode = load_mode(ROOT / p["mode_file"], lora_dir="/srv/loras")
    assert all(e["path"].startswith("/srv/loras/") for e in mode.lora_configs)


def test_declared_kv_dims_narrow_to_the_checkpoint_or_are_refused():
    """What auto-complete does to COND_KV and friends (generation models and the prompt encoder)."""
    from neopp.serving.parameters import narrow_kv_dims

    kv = [3, 2, -1, 2, 48]
    for declared in ([-1, 2, -1, -1, -1], [3, 2, -1, 2, 48], []):
        entry = {"name": "COND_KV", "dims": declared}
        narrow_kv_dims(entry, kv)
        assert entry["dims"] == kv
    for declared in ([4, 2, -1, 2, 48], [-1, 2, -1, -1, 64], [-1, 2, -1, -1]):
        with pytest.raises(ValueError, match=r"COND_KV: config.pbtxt dims .* contradict the checkpoint's"):
            narrow_kv_dims({"name": "COND_KV", "dims": declared}, kv)
