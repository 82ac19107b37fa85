"""The prompt encoder: tokenizer rules, and the language tower's prefix against a float64 reference."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from neopp.errors import ConfigError, InputError
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.text.language_tower import LanguageTower
from neopp.text.tokenizer import MAX_PROMPT_BYTES, WordTokenizer
from testing.demo_checkpoint import write_demo_checkpoint
from tests.reference.language_reference import reference_prefix

PROMPT = "a red circle on the left on a blue background"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "dense", seed=5)


@pytest.fixture(scope="module")
def tower(ckpt):
    return LanguageTower.from_pretrained(ckpt)


@pytest.mark.parametrize("prompt", [PROMPT, "", "green square at the top on a red background"])
def test_prefix_matches_the_float64_reference(ckpt, tower, prompt):
    kv, offset = tower.encode(prompt)
    ids = tower.tokenizer.encode(prompt)
    ref = reference_prefix(ckpt, ids)
    cfg = CheckpointConfig.from_checkpoint(ckpt)
    assert kv.shape == (cfg.num_layers, 2, len(ids), cfg.num_kv_heads, cfg.head_dim)
    assert offset == len(ids)
    scale = ref.abs().max().item()
    assert (kv.double() - ref).abs().max().item() <= 2e-5 * scale  # float32 against float64


def test_a_padded_batch_row_equals_the_prompt_alone(tower):
    """Causal: padding after a prompt never reaches its keys and values (training pads rows)."""
    short, long = tower.tokenizer.encode(""), tower.tokenizer.encode(PROMPT)
    ids = torch.tensor([short + [0] * (len(long) - 1), long])
    batch = tower.prefix_kv(ids)
    alone, _ = tower.encode("")
    torch.testing.assert_close(batch[0, :, :, :1], alone, rtol=1e-5, atol=1e-5)  # GEMM shapes differ: last bits


def test_tokenizer_rules(tower):
    tok = tower.tokenizer
    assert tok.encode("") == [tok.ids["<bos>"]]
    assert tok.encode("A  RED, circle!") == tok.encode("a red circle")
    assert tok.encode("an red circle") == tok.encode("a red circle")  # both articles are known
    for prompt, unknown in (("a big pink dragon flying over mountains", "['big', 'pink', 'dragon', 'flying', "
                                                                       "'over', 'mountains']"),
                            ("un cercle rouge \N{ARTIST PALETTE}", "['un', 'cercle', 'rouge']"),
                            ("a red <unk>", "['unk']")):  # the special tokens cannot be spelt either
        with pytest.raises(InputError) as info:
            tok.encode(prompt, "NEGATIVE_PROMPT")
        message = str(info.value)
        assert message.startswith(f"NEGATIVE_PROMPT: unknown words {unknown}; "), message
        assert "tokenizer.json: " in message and ", red, " in message  # the vocabulary is listed
    assert tok.encode("a zebra", known_only=False)[-1] == tok.ids["<unk>"]  # training on a larger corpus
    with pytest.raises(InputError, match="PROMPT: .*at most"):
        tok.encode("red " * tok.max_tokens)
    with pytest.raises(InputError, match=f"NEGATIVE_PROMPT: at most {MAX_PROMPT_BYTES} bytes"):
        tok.encode("x" * (MAX_PROMPT_BYTES + 1), "NEGATIVE_PROMPT")


def test_a_checkpoint_without_tokenizer_or_with_a_missing_key_is_refused(ckpt, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((ckpt / "config.json").read_text())
    save_file(load_file(str(ckpt / "model.safetensors")), str(bare / "model.safetensors"))
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        LanguageTower.from_pretrained(bare)
    (bare / "tokenizer.json").write_text((ckpt / "tokenizer.json").read_text())
    tensors = load_file(str(ckpt / "model.safetensors"))
    key = "language_model.model.layers.1.self_attn.k_norm_hw.weight"
    save_file({k: v for k, v in tensors.items() if k != key}, str(bare / "model.safetensors"))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        LanguageTower.from_pretrained(bare)


def test_a_bad_tokenizer_file_is_refused(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"kind": "word-level", "vocab": ["a", "b"], "max_tokens": 8}))
    with pytest.raises(ConfigError, match="must start with"):
        WordTokenizer.from_file(path)
