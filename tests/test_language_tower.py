"""The prompt encoder: tokenizer rules, and the language tower's prefix against a float64 reference."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from neopp.errors import ConfigError, InputError
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.text.language_tower import LanguageTower
from neopp.text.tokenizer import DEMO_PROMPT_BYTES, WordTokenizer
from testing import REPO
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
    kv, offset = tower.conditional(prompt)
    ids = tower.prompt_ids.tokenizer.encode(prompt)
    ref = reference_prefix(ckpt, ids)
    cfg = CheckpointConfig.from_checkpoint(ckpt)
    assert kv.shape == (cfg.num_layers, 2, len(ids), cfg.num_kv_heads, cfg.head_dim)
    assert offset == len(ids)
    scale = ref.abs().max().item()
    assert (kv.double() - ref).abs().max().item() <= 2e-5 * scale  # float32 against float64


def test_a_padded_batch_row_equals_the_prompt_alone(tower):
    """Causal: padding after a prompt never reaches its keys and values (training pads rows)."""
    short, long = tower.prompt_ids.tokenizer.encode(""), tower.prompt_ids.tokenizer.encode(PROMPT)
    ids = torch.tensor([short + [0] * (len(long) - 1), long])
    batch = tower.prefix_kv(ids)
    alone, _ = tower.unconditional("")
    torch.testing.assert_close(batch[0, :, :, :1], alone, rtol=1e-5, atol=1e-5)  # GEMM shapes differ: last bits


def test_tokenizer_rules(tower):
    tok = tower.prompt_ids.tokenizer
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
    with pytest.raises(InputError, match=f"NEGATIVE_PROMPT: at most {DEMO_PROMPT_BYTES} bytes"):
        tok.encode("x" * (DEMO_PROMPT_BYTES + 1), "NEGATIVE_PROMPT")


def test_a_checkpoint_without_tokenizer_or_with_a_missing_key_is_refused(ckpt, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((ckpt / "config.json").read_text())
    save_file(load_file(str(ckpt / "model.safetensors")), str(bare / "model.safetensors"))
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        LanguageTower.from_pretrained(bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).write_text((ckpt / name).read_text())
    tensors = load_file(str(ckpt / "model.safetensors"))
    key = "language_model.model.layers.1.self_attn.k_norm_hw.weight"
    save_file({k: v for k, v in tensors.items() if k != key}, str(bare / "model.safetensors"))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        LanguageTower.from_pretrained(bare)


def test_a_bad_tokenizer_file_is_refused(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1}}}))
    with pytest.raises(ConfigError, match="must start with"):
        WordTokenizer.from_file(path)
    path.write_text(json.dumps({"model": {"type": "WordLevel", "vocab": {"a": 0, "b": 2}}}))
    with pytest.raises(ConfigError, match=r"ids must be 0\.\.1"):
        WordTokenizer.from_file(path)
    path.write_text(json.dumps({"kind": "word-level", "vocab": ["a", "b"], "max_tokens": 8}))
    with pytest.raises(ConfigError, match="must be a WordLevel one"):
        WordTokenizer.from_file(path)


@pytest.mark.parametrize(("prompt", "ids"), [
    ("a red circle on the left on a blue background", [1, 3, 17, 10, 14, 20, 13, 14, 3, 7, 5]),
    ("An orange Triangle at the top, on white!", [1, 3, 15, 22, 4, 20, 21, 14, 23]),
    ("", [1]),
    ("the green square in the center on a black background", [1, 20, 11, 19, 12, 20, 9, 14, 3, 6, 5]),
])
@pytest.mark.parametrize("folder", ["dense", "moe"])
def test_the_committed_demo_tokenizer_keeps_its_ids(prompt, ids, folder):
    """The ids the demo's word-level file gave before it became a WordLevel tokenizer.json: the
    committed weights were trained on them, so its pictures depend on them."""
    tokenizer = WordTokenizer.from_file(REPO / "demo" / "checkpoints" / folder / "tokenizer.json")
    assert tokenizer.encode(prompt) == ids
    assert tokenizer.max_tokens == 32
