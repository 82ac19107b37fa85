"""Think mode on a SenseNova-U1 checkpoint against a float64 reference of the official rule.

The reference (``language_reference.reference_think``) runs the whole sequence again at every
step and writes the argmax; ours extends a KV cache one token at a time in float32. The ids
must be equal, the prefix within float32 rounding of the float64 one. Three ways to end are
covered: the token cap (random weights), ``</think>`` and the end of the turn (a checkpoint whose
lm_head row for that token points along the first step's hidden state, so it wins at once).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from neopp.contract.inputs import MAX_THINK_TOKENS
from neopp.errors import InputError
from neopp.text.language_tower import LM_HEAD, LanguageTower
from neopp.text.think import can_think, think
from testing import tiny_u1
from testing.demo_checkpoint import write_demo_checkpoint
from tests.reference.language_reference import reference_forward, reference_prefix, reference_think
from tests.reference.u1_prompts import expected_ids

PROMPT = "a red cat on the mat — 猫!"


def think_pieces(prompt: str) -> list[str]:
    """The think-mode query written out: the conditional turns, then an open think block."""
    from neopp.text.prompt_template import GENERATION_SYSTEM_MESSAGE

    return ["<|im_start|>", "system\n" + GENERATION_SYSTEM_MESSAGE, "<|im_end|>", "\n", "<|im_start|>",
            "user\n" + prompt, "<|im_end|>", "\n", "<|im_start|>", "assistant\n", "<think>", "\n"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_u1.write_tiny_u1_checkpoint(tmp_path_factory.mktemp("u1") / "dense", seed=5)


@pytest.fixture(scope="module")
def bare():
    return tiny_u1.bare_bpe()


def query_and_tail(bare) -> tuple[list[int], list[int]]:
    return expected_ids(bare, think_pieces(PROMPT)), expected_ids(bare, ["\n\n", "<img>"])


def check_against_reference(ckpt, bare, cap: int) -> list[int]:
    tower = LanguageTower.from_pretrained(ckpt)
    query, tail = query_and_tail(bare)
    assert tower.prompt_ids.think_conditional(PROMPT) == query and tower.prompt_ids.image_tail() == tail
    thought = think(tower, PROMPT, cap)
    want, written = reference_think(ckpt, query, tail, tiny_u1.REAL_IDS["</think>"], tiny_u1.REAL_IDS["<|im_end|>"],
                                    cap)
    assert list(thought.ids) == want and thought.offset == len(want)
    library = Tokenizer.from_file(str(ckpt / "tokenizer.json"))  # the library's own decoding of the reasoning
    assert thought.text == library.decode(written, skip_special_tokens=False)
    ref = reference_prefix(ckpt, want)
    assert (thought.kv.double() - ref).abs().max().item() <= 2e-5 * ref.abs().max().item()
    return written


def test_the_reasoning_stops_at_the_cap(ckpt, bare):
    written = check_against_reference(ckpt, bare, 5)
    assert len(written) == 5  # random weights: neither </think> nor the end of the turn came first


def pointing(ckpt, tmp_path, token: str):
    """A copy of ``ckpt`` whose lm_head row for ``token`` lies along the first step's hidden state."""
    query, _ = query_and_tail(tiny_u1.bare_bpe())
    _, hidden, _ = reference_forward(ckpt, query)
    raw = json.loads((ckpt / "config.json").read_text())["llm_config"]
    tensors = load_file(str(ckpt / "model.safetensors"))
    normed = hidden / torch.sqrt((hidden * hidden).mean() + float(raw.get("rms_norm_eps", 1e-6)))
    norm = tensors["language_model.model.norm.weight"].double()
    head = tensors[LM_HEAD].clone()
    head[tiny_u1.REAL_IDS[token]] = (50.0 * normed * norm / (normed * norm).norm()).to(head.dtype)
    tensors[LM_HEAD] = head
    out = tmp_path / token.strip("<|>/")
    out.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((ckpt / name).read_bytes())
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_the_reasoning_stops_at_think_close_which_stays(ckpt, bare, tmp_path):
    assert check_against_reference(pointing(ckpt, tmp_path, "</think>"), bare, 8) == [tiny_u1.REAL_IDS["</think>"]]


def test_the_end_of_the_turn_stops_the_reasoning_and_is_dropped(ckpt, bare, tmp_path):
    assert check_against_reference(pointing(ckpt, tmp_path, "<|im_end|>"), bare, 8) == []


def test_the_cap_is_bounded_and_the_demo_cannot_think(ckpt, tmp_path):
    tower = LanguageTower.from_pretrained(ckpt)
    assert can_think(tower) is None
    for cap in (0, MAX_THINK_TOKENS + 1):
        with pytest.raises(InputError, match=rf"^THINK_MAX_TOKENS: must be in 1\.\.{MAX_THINK_TOKENS}, got {cap}$"):
            think(tower, PROMPT, cap)
    demo = LanguageTower.from_pretrained(write_demo_checkpoint(tmp_path / "demo", seed=1))
    with pytest.raises(InputError, match="^THINK: this checkpoint has no think mode"):
        think(demo, "a red circle")


def test_a_client_that_left_stops_the_reasoning(ckpt):
    from neopp.errors import GenerationCancelled

    asked = []

    def cancelled() -> bool:
        asked.append(1)
        return len(asked) > 2

    with pytest.raises(GenerationCancelled, match="after 2 tokens"):
        think(LanguageTower.from_pretrained(ckpt), PROMPT, 50, cancelled)
    assert len(asked) == 3
