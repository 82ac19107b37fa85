"""The prompt encoder on an A3B-shaped checkpoint: an understanding tower whose MLPs route each
token over experts (Qwen3-MoE's rule: ``num_experts``, ``mlp_only_layers``,
``decoder_sparse_step``), checked against the float64 reference written from the official rules
(``tests.reference.language_reference``), alone and prefilled together; a checkpoint whose
tensors disagree with what its config.json routes is refused, naming the tensor."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from neopp.errors import ConfigError
from neopp.model.layers import MoE, SwiGLU
from neopp.text.language_tower import LanguageTower
from neopp.text.understanding_mlp import UnderstandingMLP
from testing import tiny_u1
from tests.reference.language_reference import reference_prefix
from tests.reference.u1_prompts import cond_pieces, expected_ids, uncond_pieces

PROMPTS = ["a red cat on the mat, a blue dog!", "Ünïcödé: 猫と犬 — café « ok »?"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_u1.write_tiny_u1_checkpoint(tmp_path_factory.mktemp("a3b") / "moe", seed=5, a3b=True)


@pytest.fixture(scope="module")
def tower(ckpt):
    return LanguageTower.from_pretrained(ckpt)


def close_to_reference(kv, ckpt, ids: list[int]) -> None:
    ref = reference_prefix(ckpt, ids)
    assert kv.shape == ref.shape
    assert (kv.double() - ref).abs().max().item() <= 2e-5 * ref.abs().max().item()  # float32 against float64


def test_the_layers_route_as_config_json_says(tower):
    kinds = [type(layer.mlp) for layer in tower.layers]
    assert kinds == [MoE, MoE, SwiGLU, MoE]  # layer 2 is in mlp_only_layers
    routed = [layer.mlp for layer in tower.layers if isinstance(layer.mlp, MoE)]
    assert all(len(mlp.experts) == 3 and mlp.top_k == 2 and mlp.norm_topk_prob for mlp in routed)


def test_a_prefix_is_the_official_one(ckpt, tower):
    ids = expected_ids(tiny_u1.bare_bpe(), cond_pieces(PROMPTS[0]))
    kv, offset = tower.conditional(PROMPTS[0])
    assert offset == len(ids)
    close_to_reference(kv, ckpt, ids)


def test_prompts_prefilled_together_are_each_the_official_prefix(ckpt, tower):
    bare = tiny_u1.bare_bpe()
    sequences = [expected_ids(bare, cond_pieces(p)) for p in PROMPTS] + [expected_ids(bare, uncond_pieces("blurry"))]
    for ids, (kv, _) in zip(sequences, tower.encode_many(sequences), strict=True):
        close_to_reference(kv, ckpt, ids)


def test_the_sparse_step_and_the_dense_layers_follow_qwen3_moe():
    mlp = UnderstandingMLP.from_llm_config({"num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 2,
                                            "mlp_only_layers": [3]})
    assert [mlp.routed(i) for i in range(6)] == [False, True, False, False, False, True]
    assert not UnderstandingMLP.from_llm_config({"gen_num_experts": 4, "num_experts_per_tok": 2}).routed(0)


@pytest.mark.parametrize("llm, message", [
    ({"num_experts": 4}, "'llm_config.num_experts_per_tok' must be in 1..4"),
    ({"num_experts": 4, "num_experts_per_tok": 5}, "'llm_config.num_experts_per_tok' must be in 1..4"),
    ({"num_experts": 4.5, "num_experts_per_tok": 1}, "'llm_config.num_experts' must be a whole number"),
    ({"num_experts": 4, "num_experts_per_tok": 1, "mlp_only_layers": "0"}, "'llm_config.mlp_only_layers' must be"),
])
def test_a_config_that_cannot_route_is_refused_naming_its_key(llm, message):
    with pytest.raises(ConfigError, match=message):
        UnderstandingMLP.from_llm_config(llm)


def copy_with(ckpt, folder, config: dict | None = None, tensors: dict | None = None):
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((ckpt / name).read_bytes())
    (folder / "config.json").write_text(json.dumps(config or json.loads((ckpt / "config.json").read_text())))
    save_file(tensors or load_file(str(ckpt / "model.safetensors")), str(folder / "model.safetensors"))
    return folder


def test_tensors_that_disagree_with_the_routing_are_refused_naming_the_tensor(ckpt, tmp_path):
    tensors = load_file(str(ckpt / "model.safetensors"))
    missing = {k: v for k, v in tensors.items() if k != "language_model.model.layers.3.mlp.experts.2.up_proj.weight"}
    with pytest.raises(ConfigError, match=r"'language_model.model.layers.3.mlp.experts.2.up_proj.weight' is missing "
                                          r"\(config.json routes this layer over 3 experts"):
        LanguageTower.from_pretrained(copy_with(ckpt, tmp_path / "missing", tensors=missing))
    config = json.loads((ckpt / "config.json").read_text())
    del config["llm_config"]["num_experts"]  # the experts stay: the dense MLP the config now means is missing
    with pytest.raises(ConfigError, match=r"'language_model.model.layers.0.mlp.gate_proj.weight' is missing "
                                          r"\(config.json names no understanding experts"):
        LanguageTower.from_pretrained(copy_with(ckpt, tmp_path / "dense", config=config))
    narrow = dict(tensors)
    key = "language_model.model.layers.1.mlp.gate.weight"
    narrow[key] = narrow[key][:2].contiguous()
    with pytest.raises(ConfigError, match=rf"'{key}' has shape \(2, 64\), expected \(3, 64\)"):
        LanguageTower.from_pretrained(copy_with(ckpt, tmp_path / "narrow", tensors=narrow))


def test_think_mode_writes_through_the_routed_layers_as_the_reference_does(ckpt):
    from tests.test_u1_think import check_against_reference

    assert len(check_against_reference(ckpt, tiny_u1.bare_bpe(), 1)) == 1  # the cache extended through experts
