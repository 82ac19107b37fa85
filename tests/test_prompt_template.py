"""The official generation prompts against a reference written from the published rules.

The fixture is a small byte-level BPE ``tokenizer.json`` built here, carrying the Qwen3 / U1
special tokens at their real ids. The reference never calls this project's encoder: it writes the
expected text out plainly and builds the expected ids by splitting at the special tokens and
running the bare BPE model on each plain piece (what a Hugging Face tokenizer does with added
tokens).
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.trainers import BpeTrainer

from neopp.errors import ConfigError, InputError
from neopp.text.prompt_template import (
    GENERATION_SYSTEM_MESSAGE,
    MAX_PROMPT_CHARS,
    check_template,
    encode_conditional,
    encode_unconditional,
    load_u1_tokenizer,
)

REAL_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<think>": 151667,
            "</think>": 151668, "<IMG_CONTEXT>": 151669, "<img>": 151670, "</img>": 151671}
# The generation system message is 1175 characters; its digest pins it byte for byte.
SYSTEM_SHA256 = "97bc0d73e6f61b20689dd81ad2bcf9eb795a65de5d07dd2e2c01d16503f44492"
CORPUS = ["a red cat on the mat, a blue dog!", "Ünïcödé: 猫と犬 — café", "You are an image generation assistant."]
MAX_TOKENS = 4096


@pytest.fixture(scope="module")
def bare_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory, bare_bpe):
    raw = json.loads(bare_bpe.to_str())
    raw["model"]["vocab"].update(REAL_IDS)
    raw["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True} for t, i in REAL_IDS.items()]
    folder = tmp_path_factory.mktemp("u1")
    (folder / "tokenizer.json").write_text(json.dumps(raw), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tokenizer(ckpt_dir):
    return load_u1_tokenizer(ckpt_dir)


def expected_ids(bare: Tokenizer, pieces: list[str]) -> list[int]:
    """Special tokens by their real id wherever they occur (the system message itself names
    ``<think></think>``), every plain run through the bare BPE model."""
    split = re.compile("(" + "|".join(re.escape(t) for t in REAL_IDS) + ")")
    ids: list[int] = []
    for part in split.split("".join(pieces)):
        ids += [REAL_IDS[part]] if part in REAL_IDS else bare.encode(part, add_special_tokens=False).ids
    return ids


def cond_pieces(prompt: str) -> list[str]:
    return ["<|im_start|>", "system\n" + GENERATION_SYSTEM_MESSAGE, "<|im_end|>", "\n",
            "<|im_start|>", "user\n" + prompt, "<|im_end|>", "\n", "<|im_start|>", "assistant\n",
            "<think>", "\n\n", "</think>", "\n\n", "<img>"]


def uncond_pieces(negative: str) -> list[str]:
    return ["<|im_start|>", "user\n" + negative, "<|im_end|>", "\n", "<|im_start|>", "assistant\n", "<img>"]


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
