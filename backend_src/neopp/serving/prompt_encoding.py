"""What the prompt encoder computes for its requests: prefixes and offsets, alone or together.

A plain request (a prompt, maybe a negative prompt; no pictures, no think) is tokenized on its
own, so a prompt the tokenizer refuses ends only its own request, then prefilled with the other
plain requests that arrived with it, in one forward of the tower (``LanguageTower.encode_many``).
An edit or a think request runs alone: its prefixes hold pictures, or continue from reasoning
written token by token.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..errors import InputError
from ..text.edit_images import read_pictures
from ..text.language_tower import LanguageTower, cannot_edit
from ..text.think import think
from .prompt_parsing import PromptRequest

Outputs = dict[str, "torch.Tensor | np.ndarray"]
Prefix = tuple[torch.Tensor, int]


def prefills_together(req: PromptRequest) -> bool:
    """A request whose prefixes are plain text: it can share a forward with others."""
    return not req.images and not req.think


def prompt_sequences(tower: LanguageTower, req: PromptRequest) -> list[list[int]]:
    """A plain request's token ids: its conditional prompt, then its negative prompt's (when it
    names one; without, the cached unconditional prefix serves). Raises InputError for a prompt
    the tokenizer refuses."""
    ids = tower.prompt_ids
    return [ids.conditional(req.prompt)] + ([ids.unconditional(req.negative_prompt)] if req.negative_prompt else [])


def encode_together(tower: LanguageTower, sequences: list[list[list[int]]]) -> tuple[list[Outputs], int]:
    """Each plain request's outputs (``sequences``: each one's ``prompt_sequences``) from one
    forward, and how many sequences it ran. A sequence runs once however many requests hold it
    (the n pictures of one prompt), so a lone prompt asked n times is its solo prefix, bit for bit."""
    distinct = list(dict.fromkeys(tuple(seq) for seqs in sequences for seq in seqs))
    prefix_of = dict(zip(distinct, tower.encode_many([list(seq) for seq in distinct]), strict=True))
    outputs = []
    for seqs in sequences:
        cond = prefix_of[tuple(seqs[0])]
        uncond = prefix_of[tuple(seqs[1])] if len(seqs) > 1 else tower.unconditional("")
        outputs.append(outputs_of({"COND": cond, "UNCOND": uncond}))
    return outputs, len(distinct)


def encode_prompts(tower: LanguageTower, req: PromptRequest, cancelled: Callable[[], bool] | None = None) -> Outputs:
    """One request's outputs: BF16 prefixes (online layout), INT64 [1] offsets, and the reasoning
    of think mode (its conditional prefix continues from it; "" without THINK), which ``cancelled``
    stops. With ``IMAGES``, the pictures sit in the conditional prefix and make the image-only one."""
    pictures = None
    if req.images:
        why = cannot_edit(tower)
        if why is not None:
            raise InputError(f"IMAGES: {why}")
        pictures = tower.embed_pictures(read_pictures(req.images))
    cond, reasoning = None, ""
    if req.think:
        thought = think(tower, req.prompt, req.think_max_tokens, cancelled, pictures)
        cond, reasoning = (thought.kv, thought.offset), thought.text
    if pictures is not None:  # think mode wrote its own conditional prefix
        edited, image_only = tower.edit_prefixes(req.prompt, pictures, with_cond=cond is None)
        prefixes = {"COND": cond or edited, "IMAGE": image_only}
    else:
        prefixes = {"COND": cond or tower.conditional(req.prompt)}
    prefixes["UNCOND"] = tower.unconditional(req.negative_prompt)
    return outputs_of(prefixes, reasoning)


def outputs_of(prefixes: dict[str, Prefix], reasoning: str = "") -> Outputs:
    """``<BRANCH>_KV`` (BF16, on the CPU) and ``INDEX_OFFSET_<BRANCH>`` per branch, and ``THINK_TEXT``."""
    outputs: Outputs = {}
    for branch, (kv, offset) in prefixes.items():
        outputs[f"{branch}_KV"] = kv.to(device="cpu", dtype=torch.bfloat16).contiguous()
        outputs[f"INDEX_OFFSET_{branch}"] = np.array([offset], dtype=np.int64)
    outputs["THINK_TEXT"] = np.array([reasoning.encode("utf-8")], dtype=np.object_)
    return outputs
