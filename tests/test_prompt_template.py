"""The official generation prompts against a reference written from the published rules.

The fixture is a small byte-level BPE ``tokenizer.json`` built here, carrying the Qwen3 / U1
special tokens at their real ids. The reference never calls this project's encoder: it writes the
expected text out plainly and builds the expected ids by splitting at the special tokens and
running the bare BPE model on each plain piece (what a Hugging Face tokenizer does with added
tokens).
"""

from __future__ import annotations

import hashlib

import pytest
from tokenizers import Tokenizer

from neopp.contract.inputs import MAX_PROMPT_CHARS
from neopp.errors import ConfigError, InputError
from neopp.text.prompt_template import (
    GENERATION_SYSTEM_MESSAGE,
    check_template,
    encode_conditional,
    encode_unconditional,
    load_u1_tokenizer,
)
from testing import tiny_u1
from tests.reference.u1_prompts import cond_pieces, expected_ids, uncond_pieces

# The generation system message is 1175 characters; its digest pins it byte for byte.
SYSTEM_SHA256 = "97bc0d73e6f61b20689dd81ad2bcf9eb795a65de5d07dd2e2c01d16503f44492"
MAX_TOKENS = 4096


@pytest.fixture(scope="module")
def bare_bpe() -> Tokenizer:
    return tiny_u1.bare_bpe()


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory, bare_bpe):
    return tiny_u1.write_u1_tokenizer(tmp_path_factory.mktemp("u1"), bare_bpe)


@pytest.fixture(scope="module")
def tokenizer(ckpt_dir):
    return load_u1_tokenizer(ckpt_dir)


def test_system_message_is_the_official_one():
    assert len(GENERATION_SYSTEM_MESSAGE) == 1175
    assert hashlib.sha256(GENERATION_SYSTEM_MESSAGE.encode("utf-8")).hexdigest() == SYSTEM_SHA256


@pytest.mark.parametrize("prompt", ["a red cat on the mat, a blue dog!", "Ünïcödé: 猫と犬 — café « ok »?",
                                    "  spaces\tand\nnewlines  "])
def test_conditional_prefix(tokenizer, bare_bpe, prompt):
    got = encode_conditional(tokenizer, prompt, MAX_TOKENS)
    assert "".join(cond_pieces(prompt)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<img>")
    want = expected_ids(bare_bpe, cond_pieces(prompt))
    assert list(got.ids) == want
    assert got.ids[0] == 151644 and got.ids[-1] == 151670
    assert got.ids.count(151667) == 2  # one <think> in the system message, one opening the closed block
    assert got.index_offset == len(want)
    assert got.positions == tuple((t, 0, 0) for t in range(len(want)))


def test_unconditional_prefix_is_the_empty_user_turn(tokenizer):
    got = encode_unconditional(tokenizer, "", MAX_TOKENS)
    # <|im_start|> user \n <|im_end|> \n <|im_start|> assistant \n <img>: no system turn
    text_ids = [tokenizer.encode(s) for s in ("user\n", "\n", "assistant\n")]
    want = [151644, *text_ids[0], 151645, *text_ids[1], 151644, *text_ids[2], 151670]
    assert list(got.ids) == want
    assert got.index_offset == len(want)


def test_negative_prompt_takes_the_unconditional_text(tokenizer, bare_bpe):
    negative = "blurry, a dog — 犬"
    got = encode_unconditional(tokenizer, negative, MAX_TOKENS)
    want = expected_ids(bare_bpe, uncond_pieces(negative))
    assert list(got.ids) == want and got.index_offset == len(want)
    assert 151667 not in got.ids  # the think block belongs to the conditional prefix only


@pytest.mark.parametrize(("name", "encode"), [("PROMPT", encode_conditional),
                                              ("NEGATIVE_PROMPT", encode_unconditional)])
def test_too_long_prompt_is_refused_by_name(tokenizer, name, encode):
    with pytest.raises(InputError, match=rf"^{name}: its prefix makes \d+ tokens, at most 400$"):
        encode(tokenizer, "cat " * 500, 400)
    with pytest.raises(InputError, match=rf"^{name}: at most {MAX_PROMPT_CHARS} characters$"):
        encode(tokenizer, "x" * (MAX_PROMPT_CHARS + 1), MAX_TOKENS)


def test_a_tokenizer_without_the_special_tokens_is_refused(tmp_path, bare_bpe):
    (tmp_path / "tokenizer.json").write_text(bare_bpe.to_str(), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"special token '<\|im_start\|>' is missing"):
        load_u1_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ConfigError, match="not a Hugging Face tokenizer file"):
        load_u1_tokenizer(tmp_path)


def test_only_the_trained_layout_is_accepted():
    check_template("neo1_0")
    with pytest.raises(ConfigError, match="'template' must be 'neo1_0'"):
        check_template("internvl2_5")
