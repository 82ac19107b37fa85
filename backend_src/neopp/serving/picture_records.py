"""The record a generation model writes into each picture it serves
(:mod:`neopp.contract.picture_record`).

The owner of a model's engine builds it once per request, at admission, from what it decided:
the sampling values after the mode's defaults and an adapter's recommendations, the size, where
the noise came from. The prompts and think mode are not the generation model's to know: a
model that composed the request (``neopp_t2i``, the door's ``/v1``; the session model forwards
a client's own) passes them as ``RECORD_*`` inputs, which change no pixel. The prompts are
written only where the model's ``record_prompt`` parameter allows (prompts can be private).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import __version__
from ..contract.inputs import MAX_THINK_TOKENS
from ..contract.picture_record import RECORD_VERSION, record_text
from ..errors import InputError
from .prompt_parsing import prompt_text

if TYPE_CHECKING:
    from ..request import GenerationRequest

SOFTWARE = f"neopp {__version__}"


@dataclass(frozen=True)
class RecordedInputs:
    """The ``RECORD_*`` inputs of one request."""

    prompt: str | None = None
    negative_prompt: str | None = None
    think_max_tokens: int = 0  # 0: the prefix was not thought over


def recorded_inputs(inputs: Mapping[str, Any]) -> RecordedInputs:
    """``RECORD_PROMPT``, ``RECORD_NEGATIVE_PROMPT`` (prompts, at a prompt's bound) and
    ``RECORD_THINK`` (0, or think mode's token cap)."""
    prompts = {name: prompt_text(name, inputs[name]) if inputs.get(name) is not None else None
               for name in ("RECORD_PROMPT", "RECORD_NEGATIVE_PROMPT")}
    think = 0
    if inputs.get("RECORD_THINK") is not None:
        value = np.asarray(inputs["RECORD_THINK"])
        if value.dtype != np.int64 or value.shape != (1,):
            raise InputError(f"RECORD_THINK: must be INT64 of shape [1], got {value.dtype} {list(value.shape)}")
        think = int(value[0])
        if not 0 <= think <= MAX_THINK_TOKENS:
            raise InputError(f"RECORD_THINK: 0 (no think mode) or think mode's cap, 1..{MAX_THINK_TOKENS}; "
                             f"got {think}")
    return RecordedInputs(prompts["RECORD_PROMPT"] or None, prompts["RECORD_NEGATIVE_PROMPT"] or None, think)


@dataclass(frozen=True)
class RecordSource:
    """What a model's records share: its name, mode, checkpoint, and whether prompts are kept."""

    model: str
    mode: str
    checkpoint: str
    checkpoint_sha256: str
    keep_prompts: bool = False


def request_record(source: RecordSource, req: GenerationRequest, seed: int | str,
                   resize: tuple[int, int] | None = None, recorded: RecordedInputs = RecordedInputs()) -> str:
    """The record of one request, as the file holds it."""
    s = req.sampling_params
    doc: dict[str, Any] = {
        "record": RECORD_VERSION, "software": SOFTWARE, "model": source.model, "mode": source.mode,
        "checkpoint": source.checkpoint, "checkpoint_sha256": source.checkpoint_sha256,
        "width": req.width, "height": req.height,
        "resize": [int(resize[0]), int(resize[1])] if resize else None,
        "steps": s.infer_steps, "guidance_scale": float(s.cfg_scale),
        "guidance_interval": [float(v) for v in s.cfg_interval], "guidance_norm": s.cfg_norm,
        "image_guidance_scale": float(s.image_guidance_scale) if req.image_editing else None,
        "timestep_shift": float(s.timestep_shift), "seed": seed,
        "lora": req.lora, "lora_scale": float(req.lora_scale) if req.lora else None,
        "cache": s.cache, "cache_threshold": None if s.cache_threshold is None else float(s.cache_threshold),
        "think": recorded.think_max_tokens > 0,
        "think_max_tokens": recorded.think_max_tokens or None, "edit": req.image_editing,
    }
    if source.keep_prompts:
        doc.update(prompt=recorded.prompt, negative_prompt=recorded.negative_prompt)
    return record_text(doc)
