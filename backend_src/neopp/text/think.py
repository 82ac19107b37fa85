"""Think mode: the understanding tower reasons in text before the image, as the official code does.

The conditional prefix opens the think block (``...<|im_start|>assistant\\n<think>\\n``) instead of
closing it. The tower then writes greedily, one token at a time over its growing KV cache, until
it writes ``</think>`` (kept in the prefix), the chat's end of turn ``<|im_end|>`` (not kept), or
the token cap. ``\\n\\n<img>`` follows, and the image starts after it: the conditional prefix is
the query, the reasoning and that tail, at consecutive positions, and the index offset is the
position after it (its length, unless an edit's pictures sit in the query: each takes one
position). The unconditional prefix is the one of non-think mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..contract.inputs import DEFAULT_THINK_TOKENS
from ..errors import GenerationCancelled, InputError
from ..request import check_think_tokens
from .language_tower import EmbeddedPictures, LanguageTower
from .prompt_ids import U1PromptIds


@dataclass(frozen=True)
class Thought:
    """The conditional prefix of a think-mode request and the reasoning it holds."""

    kv: torch.Tensor  # [NL, 2, S, NKV, HD]
    offset: int
    ids: tuple[int, ...]
    text: str  # the reasoning as the tokenizer decodes it, special tokens kept (``</think>`` ends it)


def can_think(tower: LanguageTower) -> str | None:
    """Why this checkpoint cannot think, or None."""
    if not isinstance(tower.prompt_ids, U1PromptIds):
        return "this checkpoint has no think mode (the demo's prompts have no chat template)"
    if tower.head is None:
        return "this checkpoint has no output head (language_model.model.norm.weight) to write with"
    return None


@torch.inference_mode()
def think(tower: LanguageTower, prompt: str, max_tokens: int = DEFAULT_THINK_TOKENS,
          cancelled: Callable[[], bool] | None = None, pictures: EmbeddedPictures | None = None) -> Thought:
    """The think-mode conditional prefix of ``PROMPT`` (and an edit's ``pictures``): greedy
    reasoning, then ``\\n\\n<img>``. ``cancelled`` is asked before each token: a client that left
    stops the reasoning there."""
    why = can_think(tower)
    if why is not None:
        raise InputError(f"THINK: {why}")
    prompt_ids: U1PromptIds = tower.prompt_ids  # type: ignore[assignment]
    marks, tail = prompt_ids.think_marks(), prompt_ids.image_tail()
    if pictures is None:
        ids, positions, embeds = prompt_ids.think_conditional(prompt), None, ()
    else:
        ids = prompt_ids.edit_conditional(prompt, pictures.grids, think=True)
        positions, embeds = prompt_ids.positions(ids, pictures.grids), pictures.tokens
    cache = tower.cache(len(ids) + check_think_tokens(max_tokens) + len(tail))
    hidden = tower.extend(cache, ids, positions, embeds)
    written: list[int] = []
    for _ in range(max_tokens):
        if cancelled is not None and cancelled():
            raise GenerationCancelled(f"during the reasoning, after {len(written)} tokens")
        token = int(torch.argmax(tower.logits(hidden)))
        if token == marks.end_of_turn:
            break
        written.append(token)
        hidden = tower.extend(cache, [token])
        if token == marks.think_close:
            break
    tower.extend(cache, tail)
    full = (*ids, *written, *tail)
    return Thought(cache.prefix(), cache.position, full, prompt_ids.decode(written))
