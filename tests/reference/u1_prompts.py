"""The U1 generation prompts written out plainly from the published rules, and their ids.

Independent of this project's encoder: the expected text is spelt piece by piece, and its ids
come from splitting at the special tokens and running the bare BPE model on each plain run
(what a Hugging Face tokenizer does with added tokens).
"""

from __future__ import annotations

import re

from tokenizers import Tokenizer

from neopp.text.prompt_template import GENERATION_SYSTEM_MESSAGE
from testing.tiny_u1 import REAL_IDS


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
