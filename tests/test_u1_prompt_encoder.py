"""The prompt encoder on a SenseNova-U1 checkpoint: its own tokenizer, the official template, the
understanding tower, against references that never call this project's encoder.

The checkpoint is tiny but real in form (``testing.tiny_u1``): the understanding tower's key
names and config, a byte-level BPE tokenizer with the special tokens at their real ids, and
``template: neo1_0``. Ids are compared with the template written out plainly
(``tests.reference.u1_prompts``); prefixes with the float64 tower (``language_reference``).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from neopp.errors import ConfigError, InputError
from neopp.serving.prompt_encoding import encode_prompts
from neopp.serving.prompt_parsing import PromptRequest
from neopp.text.language_tower import LanguageTower
from neopp.text.prompt_ids import U1PromptIds
from testing import tiny_u1
from tests.reference.language_reference import reference_prefix
from tests.reference.u1_prompts import cond_pieces, expected_ids, uncond_pieces

PROMPTS = ["a red cat on the mat, a blue dog!", "Ünïcödé: 猫と犬 — café « ok »?"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_u1.write_tiny_u1_checkpoint(tmp_path_factory.mktemp("u1") / "dense", seed=3)


@pytest.fixture(scope="module")
def tower(ckpt):
    return LanguageTower.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def bare():
    return tiny_u1.bare_bpe()


def close_to_reference(kv: torch.Tensor, ckpt, ids: list[int]) -> None:
    ref = reference_prefix(ckpt, ids)
    assert kv.shape == ref.shape
    assert (kv.double() - ref).abs().max().item() <= 2e-5 * ref.abs().max().item()  # float32 against float64


def test_a_u1_checkpoint_reads_its_template_and_tokenizer(tower):
    assert isinstance(tower.prompt_ids, U1PromptIds)
    assert tower.prompt_ids.vocabulary_size() == 151672  # </img> is 151671
    assert tower.prompt_ids.max_tokens == 4096  # the tokenizer's 131072 is over the bound


CASES = [("conditional", prompt, cond_pieces) for prompt in PROMPTS] + \
    [("unconditional", negative, uncond_pieces) for negative in ("", "blurry, a dog — 犬")]


@pytest.mark.parametrize(("kind", "text", "pieces"), CASES)
def test_each_prefix_is_the_official_one(ckpt, tower, bare, kind, text, pieces):
    """The conditional prefix holds PROMPT; the unconditional one NEGATIVE_PROMPT in its user turn."""
    ids = expected_ids(bare, pieces(text))
    assert getattr(tower.prompt_ids, kind)(text) == ids
    kv, offset = getattr(tower, kind)(text)
    assert offset == len(ids)
    close_to_reference(kv, ckpt, ids)


def test_prompts_prefilled_together_are_each_the_official_prefix(ckpt, tower, bare):
    """One forward for several sequences of different lengths: each attends only to its own tokens,
    at its own positions, so each is the reference's prefix of that sequence alone."""
    sequences = [expected_ids(bare, cond_pieces(p)) for p in PROMPTS] + [expected_ids(bare, uncond_pieces("blurry"))]
    assert len({len(ids) for ids in sequences}) == len(sequences)  # ragged: no two alike
    prefixes = tower.encode_many(sequences)
    for ids, (kv, offset) in zip(sequences, prefixes, strict=True):
        assert offset == len(ids)
        close_to_reference(kv, ckpt, ids)


def test_the_plain_unconditional_prefix_is_computed_once(ckpt, bare):
    tower = LanguageTower.from_pretrained(ckpt)
    first, offset = tower.unconditional("")
    assert tower.unconditional()[0] is first  # reused, not recomputed
    ids = expected_ids(bare, uncond_pieces(""))
    assert offset == len(ids) and torch.equal(first, tower.encode_ids(ids)[0])
    assert tower.unconditional("blurry")[0] is not tower.unconditional("blurry")[0]  # a negative prompt: per request


def test_the_model_answers_bf16_prefixes_and_their_offsets(ckpt, tower, bare):
    out = encode_prompts(tower, PromptRequest(PROMPTS[0], "blurry"))
    cond_ids, uncond_ids = expected_ids(bare, cond_pieces(PROMPTS[0])), expected_ids(bare, uncond_pieces("blurry"))
    assert out["COND_KV"].dtype == torch.bfloat16 and out["UNCOND_KV"].dtype == torch.bfloat16
    assert out["INDEX_OFFSET_COND"].tolist() == [len(cond_ids)]
    assert out["INDEX_OFFSET_UNCOND"].tolist() == [len(uncond_ids)]
    for name, ids in (("COND_KV", cond_ids), ("UNCOND_KV", uncond_ids)):
        ref = reference_prefix(ckpt, ids)
        # bf16 keeps 8 bits of mantissa: within one rounding of the float64 value, relative
        assert (out[name].double() - ref).abs().max().item() <= 2 ** -8 * ref.abs().max().item()


def test_a_prompt_too_long_for_its_prefix_is_refused_by_name(tower):
    with pytest.raises(InputError, match=r"^PROMPT: its prefix makes \d+ tokens, at most 4096$"):
        tower.conditional("猫" * 4000)  # under the characters' bound, over the tokens'
    with pytest.raises(InputError, match=r"^NEGATIVE_PROMPT: at most 8192 characters$"):
        tower.unconditional("x" * 8193)


def test_a_checkpoint_naming_another_template_or_experts_is_refused(ckpt, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (other / name).write_bytes((ckpt / name).read_bytes())
    config = json.loads((ckpt / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "template": "internvl2_5"}))
    with pytest.raises(ConfigError, match="'template' must be 'neo1_0'"):
        LanguageTower.from_pretrained(other)
    (other / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(ckpt / "model.safetensors"))
    moe = {k.replace("mlp.gate_proj", "mlp.experts.0.gate_proj"): v for k, v in tensors.items()}
    save_file(moe, str(other / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"mlp.gate_proj.weight' is missing \(config.json names no understanding "
                                          "experts"):  # experts where config.json routes none
        LanguageTower.from_pretrained(other)


def test_an_embedding_short_of_the_tokenizer_ids_is_refused(ckpt, tmp_path):
    short = tmp_path / "short"
    short.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (short / name).write_bytes((ckpt / name).read_bytes())
    tensors = load_file(str(ckpt / "model.safetensors"))
    key = "language_model.model.embed_tokens.weight"
    tensors[key] = tensors[key][:151000].contiguous()
    save_file(tensors, str(short / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"embed_tokens\.weight' has shape \(151000, 64\), expected \(151672, 64\)"):
        LanguageTower.from_pretrained(short)
