"""The layout writer (``neopp.tools.gpu_layout``): nodes of 1, 2, 4 and 8 GPUs of 24, 80 and 141 GB.

Its memory figures are checked against the deployment guide's at the 8B geometry and against the
tiny checkpoints' own tensors; every layout it writes is run through the check a model runs at
load (``neopp.serving.placement.check_layout``) and against the memory of the card; the modes a
node cannot place or hold are named, with the reason, in the summary and in their files; a bad
GPU count is refused; the shipped ``h200x1`` and ``h200x8`` are its output; and ``make serve
GPUS=N`` writes the layout and loads only what it serves (read from make's dry run).
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from google.protobuf import text_format
from safetensors.torch import load_file
from tritonclient.grpc import model_config_pb2 as mc

from bench.geometry import EIGHT_B, tower_shapes
from neopp.errors import ConfigError
from neopp.limits import Limits
from neopp.model.checkpoint import LM, is_generation_key, layer_prefix
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.modes import load_mode
from neopp.serving.placement import check_layout, model_placement, read_placement_fields
from neopp.text.language_tower import is_language_key
from neopp.tools import gpu_layout
from neopp.tools.gpu_memory import (
    GB,
    encoder_need,
    generation_sizes,
    generation_tower,
    language_sizes,
    language_tower,
    rank_need,
)
from testing import MODEL_REPOSITORY as REPO
from testing import REPO as ROOT
from testing.tiny_checkpoint import write_tiny_checkpoint
from testing.tiny_u1 import write_tiny_u1_checkpoint

COUNTS, MEMORIES = (1, 2, 4, 8), (24, 80, 141)


def understanding_shapes(cfg: CheckpointConfig, vocab: int = 151_936, mlp: int = EIGHT_B.mlp) -> dict:
    """The 8B understanding tower's keys and shapes (untied lm_head, as U1-8B)."""
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {LM + "embed_tokens.weight": (vocab, d), "language_model.lm_head.weight": (vocab, d),
              LM + "norm.weight": (d,)}
    for i in range(cfg.num_layers):
        p, a = layer_prefix(i), layer_prefix(i) + "self_attn."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       a + "q_proj.weight": (q, d), a + "k_proj.weight": (kv, d), a + "v_proj.weight": (kv, d),
                       a + "o_proj.weight": (d, q), p + "mlp.gate_proj.weight": (mlp, d),
                       p + "mlp.up_proj.weight": (mlp, d), p + "mlp.down_proj.weight": (d, mlp)})
        shapes.update({f"{a}{n}.weight": (cfg.head_dim // 2,) for n in ("q_norm", "k_norm", "q_norm_hw", "k_norm_hw")})
    return shapes


CFG_8B = CheckpointConfig.from_dict(EIGHT_B.config())
CFG_MOE = CheckpointConfig.from_dict(replace(EIGHT_B, experts=64, top_k=8).config())  # E x I = 98,304
DENSE_8B = generation_sizes(CFG_8B, tower_shapes(CFG_8B))
MOE_8B = generation_sizes(CFG_MOE, tower_shapes(CFG_MOE, mlp_width=1536))
ENCODER_8B = language_sizes(CFG_8B, understanding_shapes(CFG_8B))


def mode(name: str):
    return load_mode(ROOT / "configs" / "neopp" / f"{name}.json")


def test_memory_is_the_guide_s_at_the_8b_geometry():
    """docs/deployment.md: 14.1 GB bf16, 7.1 GB FP8, 90 GB for an MoE of E x I = 98,304, 16.4 GB for
    the encoder; per GPU 25.9 (dense with CFG), 20.5 (8-step, CFG rank), 17.8 (CFG x Ulysses rank)."""
    assert [round(t / GB, 1) for t in (DENSE_8B.bf16_bytes, DENSE_8B.fp8_bytes, MOE_8B.bf16_bytes,
                                       ENCODER_8B.bf16_bytes)] == [14.1, 7.1, 90.2, 16.4]
    assert DENSE_8B.kv_token_bytes == 144 * 1024 and DENSE_8B.row_bytes == 108 * 1024
    needs = {m: rank_need(mode(m), DENSE_8B, Limits()) for m in
             ("neopp_dense", "neopp_dense_8steps", "neopp_dense_parallel_cfg", "neopp_dense_parallel_cfg_seq")}
    assert {m: round(n.total / GB, 1) for m, n in needs.items()} == {
        "neopp_dense": 25.9, "neopp_dense_8steps": 20.5, "neopp_dense_parallel_cfg": 20.5,
        "neopp_dense_parallel_cfg_seq": 17.8}
    assert round(needs["neopp_dense"].kv / GB, 2) == 9.66  # two prefixes of 32,768 tokens
    smaller = rank_need(mode("neopp_dense"), DENSE_8B, Limits(max_prefix_tokens=1000))
    assert round(smaller.kv / GB, 2) == 0.29  # the model's own max_prefix_tokens is what is planned


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("ckpt")
    return {"u1": write_tiny_u1_checkpoint(base / "u1", seed=3), "moe": write_tiny_checkpoint(base / "moe", "moe")}


def test_tiny_sizes_are_every_loaded_tensor_in_bf16(checkpoints):
    """Read from the headers alone; counted here from the tensors themselves."""
    tensors = load_file(str(checkpoints["u1"] / "model.safetensors"))
    for reader, wanted in ((generation_tower, is_generation_key), (language_tower, is_language_key)):
        numel = sum(t.numel() for k, t in tensors.items() if wanted(k))
        assert reader(checkpoints["u1"]).bf16_bytes == 2 * numel
    moe = load_file(str(checkpoints["moe"] / "model.safetensors"))
    assert generation_tower(checkpoints["moe"]).bf16_bytes == 2 * sum(t.numel() for k, t in moe.items()
                                                                      if is_generation_key(k))


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the model repository (config.pbtxt only) beside the shipped mode files."""
    monkeypatch.delenv("NEOPP_BASE_DIR", raising=False)
    for config in REPO.glob("*/config.pbtxt"):
        (tmp_path / "model_repository" / config.parent.name).mkdir(parents=True)
        shutil.copy(config, tmp_path / "model_repository" / config.parent.name)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    return tmp_path / "model_repository"


# The generation models each node leaves out with the 8B towers, a 90 GB MoE and the prompt encoder.
LEFT_OUT = {
    (1, 24): {"dense", "dense_8steps", "dense_cfg", "dense_cfg_seq", "dense_cfg_stream", "dense_fp8", "dense_stream",
              "moe", "moe_cfg"},
    (2, 24): {"dense", "dense_8steps", "dense_cfg", "dense_cfg_seq", "dense_cfg_stream", "dense_stream", "moe",
              "moe_cfg"},
    (4, 24): {"dense", "dense_8steps", "dense_cfg_seq", "dense_stream", "moe", "moe_cfg"},
    (8, 24): {"dense", "dense_8steps", "dense_stream", "moe", "moe_cfg"},
    (1, 80): {"dense_cfg", "dense_cfg_seq", "dense_cfg_stream", "dense_fp8", "moe", "moe_cfg"},
    (2, 80): {"dense_8steps", "dense_cfg_seq", "moe", "moe_cfg"},
    (4, 80): {"dense_8steps", "moe", "moe_cfg"},
    (8, 80): {"moe", "moe_cfg"},
    (1, 141): {"dense_cfg", "dense_cfg_seq", "dense_cfg_stream", "moe", "moe_cfg"},
    (2, 141): {"dense_cfg_seq", "moe", "moe_cfg"},
    (4, 141): set(),
    (8, 141): set(),
}


def loads_and_fits(repo: Path, plan: gpu_layout.Plan, models: dict, towers: dict) -> None:
    """Every written file passes the load-time check on ``plan.count`` GPUs (a model it does not serve,
    with none), and the needs of the models it places, read back from the files, fit every card."""
    held = dict.fromkeys(range(plan.count), 0)
    for path in sorted(repo.glob(f"*/configs/{plan.name}.pbtxt")):
        own, model = read_placement_fields(path.read_text()), models[path.parent.parent.name]
        placement = check_layout(own, path.parent.parent, model.mode.world_size,
                                 plan.count if plan.served(model.name) else 0)
        assert bool(placement.gpus) == bool(plan.models[model.name].gpus)
        if placement.gpus:
            need = rank_need(model.mode, towers[model.mode.version], Limits.from_params(model.params))
            for gpu in placement.gpus:
                held[gpu] += need.total
        else:
            assert own["parameters"]["device"]["string_value"] == ("cpu" if not plan.served(model.name) else "auto")
    if plan.served(gpu_layout.ENCODER):
        held[0] += encoder_need(ENCODER_8B).total
    assert all(total <= plan.memory_gb * GB for total in held.values()), held


@pytest.mark.parametrize("memory", MEMORIES)
@pytest.mark.parametrize("count", COUNTS)
def test_each_node_s_layout_loads_fits_and_names_what_it_leaves_out(repo, count, memory):
    models = gpu_layout.read_models(repo)
    towers = {"dense": DENSE_8B, "moe": MOE_8B}
    plan = gpu_layout.plan_layout(models, count, memory, towers, ENCODER_8B, list(models))
    written = gpu_layout.write_layout(plan, models)
    assert sorted(p.parent.parent.name for p in written) == sorted(m for m in models if models[m].mode)
    loads_and_fits(repo, plan, models, towers)
    left = {m.removeprefix("neopp_") for m, p in plan.models.items() if p.reason}
    assert left == LEFT_OUT[count, memory]
    served = gpu_layout.served_models(plan, models, list(models))
    text = gpu_layout.summary(plan, served)
    for name in left:
        reason = plan.models[f"neopp_{name}"].reason
        assert f"neopp_{name}: {reason}" in text and f"neopp_{name}" not in served
        assert f"# Not served in this layout: {reason}." in (repo / f"neopp_{name}" / "configs" /
                                                             f"{plan.name}.pbtxt").read_text()
    if count < 4:
        assert plan.models["neopp_dense_cfg_seq"].reason == f"needs 4 GPUs; this layout has {count}"
    if count == 1:
        assert plan.models["neopp_dense_cfg"].reason == "needs 2 GPUs; this layout has 1"
    assert ("neopp_t2i" in served) == ("neopp_prompt_encoder" in served) == plan.served("neopp_prompt_encoder")


def test_the_tower_over_the_card_and_the_gpu_over_its_memory_say_so(repo):
    models = gpu_layout.read_models(repo)
    plan = gpu_layout.plan_layout(models, 1, 24, {"dense": DENSE_8B, "moe": MOE_8B}, ENCODER_8B, list(models))
    assert plan.models["neopp_dense"].reason.startswith("needs 25.9 GB: 14.1 weights + 9.7 KV")
    assert plan.models["neopp_dense"].reason.endswith("per GPU, over the 24 GB card")
    assert plan.models["neopp_dense_8steps"].reason.startswith(
        "GPU 0 would hold 39.6 of 24 GB: neopp_prompt_encoder there already, and this model needs 20.5 GB")


def test_8_gpus_of_141_gb_place_every_mode_as_the_guide_s_table(repo):
    models = gpu_layout.read_models(repo)
    plan = gpu_layout.plan_layout(models, 8, 141, {"dense": DENSE_8B, "moe": MOE_8B}, ENCODER_8B, list(models))
    gpus = {m: p.gpus for m, p in plan.models.items() if p.gpus}
    assert gpus == {"neopp_dense": (0,), "neopp_dense_8steps": (0,), "neopp_dense_fp8": (1,), "neopp_moe": (1,),
                    "neopp_dense_cfg": (2, 3), "neopp_moe_cfg": (2, 3), "neopp_dense_cfg_seq": (4, 5, 6, 7),
                    "neopp_prompt_encoder": (0,)}  # where device auto puts it: planned, not written
    assert not plan.models["neopp_dense_cfg_seq"].share_with
    assert plan.models["neopp_dense_cfg"].share_with == ("neopp_moe_cfg",)


def test_4_gpus_wrap_the_4_rank_mode_over_every_other_pool(repo):
    models = gpu_layout.read_models(repo)
    plan = gpu_layout.plan_layout(models, 4, 141, {"dense": DENSE_8B, "moe": MOE_8B}, ENCODER_8B, list(models))
    assert plan.models["neopp_dense_cfg_seq"].gpus == (0, 1, 2, 3)
    assert set(plan.models["neopp_dense_cfg_seq"].share_with) == {
        "neopp_dense", "neopp_dense_8steps", "neopp_dense_fp8", "neopp_moe", "neopp_dense_cfg", "neopp_moe_cfg"}


@pytest.mark.parametrize("count", [0, 3, 5, 6, 16])
def test_other_gpu_counts_are_refused_in_words(repo, count, capsys):
    with pytest.raises(ConfigError, match=r"written for 1, 2, 4 or 8 GPUs"):
        gpu_layout.plan_layout(gpu_layout.read_models(repo), count, 80, {"dense": DENSE_8B}, None, [])
    code = gpu_layout.main(["--gpus", str(count), "--gpu-memory-gb", "80", "--repository", str(repo),
                            "--checkpoint", str(ROOT / "demo" / "checkpoints" / "dense")])
    assert code == 2 and f"error: {count} GPUs: a layout is written for 1, 2, 4 or 8" in capsys.readouterr().err
    assert not list(repo.glob("*/configs/*.pbtxt"))


def test_the_command_writes_summarises_and_says_what_it_serves(repo, checkpoints, capsys):
    args = ["--gpus", "2", "--gpu-memory-gb", "24", "--repository", str(repo), "--checkpoint", str(checkpoints["u1"]),
            "--moe-checkpoint", str(checkpoints["moe"]), "--prompt-checkpoint", str(checkpoints["u1"])]
    asked = "neopp_dense neopp_dense_cfg_seq neopp_prompt_encoder neopp_t2i"
    assert gpu_layout.main([*args, "--served", "--models", asked]) == 0
    assert capsys.readouterr().out.split() == ["neopp_dense", "neopp_prompt_encoder", "neopp_t2i"]
    assert gpu_layout.main([*args, "--served", "--models", "neopp_dense neopp_t2i"]) == 0
    assert capsys.readouterr().out.split() == ["neopp_dense"]  # neopp_t2i asks its encoder, not loaded
    assert not list(repo.glob("*/configs/*.pbtxt"))  # asking writes nothing
    assert gpu_layout.main(args) == 0
    out = capsys.readouterr().out
    assert "layout gpus2: 2 GPUs of 24 GB each" in out and "neopp_dense_cfg_seq: needs 4 GPUs; this layout has 2" in out
    assert "wrote configs/gpus2.pbtxt for 9 models" in out
    seq = (repo / "neopp_dense_cfg_seq" / "configs" / "gpus2.pbtxt").read_text()
    assert '{ key: "device" value: { string_value: "cpu" } }' in seq and "needs 4 GPUs; this layout has 2" in seq
    assert gpu_layout.main([*args[:-2], "--models", asked, "--served"]) == 0
    assert capsys.readouterr().out.split() == ["neopp_dense"]  # no prompt checkpoint: no prompts


def parse(path: Path) -> mc.ModelConfig:
    return text_format.Parse(path.read_text(), mc.ModelConfig())


def test_a_written_file_is_its_config_but_for_the_placement(repo, checkpoints):
    models = gpu_layout.read_models(repo)
    towers = {"dense": generation_tower(checkpoints["u1"]), "moe": generation_tower(checkpoints["moe"])}
    plan = gpu_layout.plan_layout(models, 2, 80, towers, language_tower(checkpoints["u1"]), list(models))
    for path in gpu_layout.write_layout(plan, models):
        layout, default = parse(path), parse(path.parent.parent / "config.pbtxt")
        for part in ("input", "output", "dynamic_batching", "model_transaction_policy", "backend"):
            assert getattr(layout, part) == getattr(default, part), (path, part)
        kept = {k: v.string_value for k, v in layout.parameters.items() if k not in ("layout", "gpus", "share_gpus")}
        assert kept == {k: v.string_value for k, v in default.parameters.items()} | (
            {"device": "cpu"} if not plan.served(path.parent.parent.name) else {})


@pytest.mark.parametrize("count,name", [(1, "h200x1"), (8, "h200x8")])
def test_the_shipped_layouts_are_the_writer_s_for_141_gb(repo, count, name):
    """Written with the demo checkpoints, where every mode the node can place fits."""
    demo = ROOT / "demo" / "checkpoints"
    assert gpu_layout.main(["--gpus", str(count), "--gpu-memory-gb", "141", "--name", name, "--repository", str(repo),
                            "--checkpoint", str(demo / "dense"), "--moe-checkpoint", str(demo / "moe"),
                            "--prompt-checkpoint", str(demo / "dense")]) == 0
    for path in sorted(REPO.glob(f"*/configs/{name}.pbtxt")):
        assert (repo / path.relative_to(REPO)).read_text() == path.read_text(), path
    assert len(list(repo.glob(f"*/configs/{name}.pbtxt"))) == len(list(REPO.glob(f"*/configs/{name}.pbtxt")))


def test_memory_per_gpu_comes_from_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="nvidia-smi is not on this machine: give the memory per GPU"):
        gpu_layout.gpu_memory_gb(1)
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\n[ "$1 $2" = "--query-gpu=memory.total --format=csv,noheader,nounits" ] || exit 9\n'
                   "printf '143771\\n81559\\n'\n")
    smi.chmod(0o755)
    assert gpu_layout.gpu_memory_gb(2) == round(81559 * 2**20 / GB, 1) == 85.5  # the smallest card, MiB -> GB
    with pytest.raises(ConfigError, match="nvidia-smi sees 2 GPUs; a layout of 4 could not load here"):
        gpu_layout.gpu_memory_gb(4)


def dry_run(*args: str) -> tuple[list[str], str]:
    done = subprocess.run(["make", "-n", "serve", "STAMP=Makefile", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return re.findall(r"--load-model=(\w+)", done.stdout), done.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_serve_gpus_writes_the_layout_and_loads_what_it_serves(checkpoints):
    before = sorted(REPO.glob("*/configs/gpus2.pbtxt"))
    models, text = dry_run(f"NEOPP_CHECKPOINT={checkpoints['u1']}", "GPUS=2", "GPU_MEMORY_GB=24")
    assert re.search(r"-m neopp\.tools\.gpu_layout --gpus 2 --gpu-memory-gb 24 .*"
                     rf"--checkpoint {re.escape(str(checkpoints['u1']))} .*--prompt-checkpoint", text)
    assert "--model-config-name=gpus2" in text
    assert "neopp_dense_cfg_seq" not in models  # 4 ranks on 2 GPUs: not served, so not loaded
    assert {"neopp_dense", "neopp_dense_cfg", "neopp_prompt_encoder", "neopp_t2i", "neopp_session"} <= set(models)
    assert sorted(REPO.glob("*/configs/gpus2.pbtxt")) == before  # a dry run writes nothing
    one, text = dry_run(f"NEOPP_CHECKPOINT={checkpoints['u1']}", "GPUS=1", "GPU_MEMORY_GB=80")
    assert "--model-config-name=gpus1" in text
    assert not {"neopp_dense_cfg", "neopp_moe_cfg", "neopp_dense_cfg_stream"} & set(one)
    plain, text = dry_run(f"NEOPP_CHECKPOINT={checkpoints['u1']}")
    assert "gpu_layout" not in text and "--model-config-name" not in text and "neopp_dense_cfg_seq" in plain


def test_moe_modes_are_off_without_an_moe_checkpoint(repo):
    models = gpu_layout.read_models(repo)
    plan = gpu_layout.plan_layout(models, 8, 141, {"dense": DENSE_8B, "moe": None}, None, list(models))
    assert plan.models["neopp_moe"].reason == plan.models["neopp_moe_cfg"].reason == "no MoE checkpoint given"
    assert plan.models["neopp_dense_fp8"].gpus == (1,) and not plan.models["neopp_dense_fp8"].share_with
    assert not plan.served("neopp_prompt_encoder")
    assert math.isclose(sum(b for _, b in plan.load[0]), rank_need(mode("neopp_dense"), DENSE_8B, Limits()).total
                        + rank_need(mode("neopp_dense_8steps"), DENSE_8B, Limits()).total)


def test_a_model_placement_reads_the_written_gpus(repo):
    models = gpu_layout.read_models(repo)
    plan = gpu_layout.plan_layout(models, 2, 141, {"dense": DENSE_8B, "moe": MOE_8B}, None, list(models))
    gpu_layout.write_layout(plan, models)
    cfg = read_placement_fields((repo / "neopp_dense_cfg" / "configs" / "gpus2.pbtxt").read_text())
    assert model_placement(cfg, 2, 2).instances == ((0, 1),)
