"""Every model's input and output tables: the one home of the public interface.

The generation tables are the parsers' own (``request_parsing``, ``stream_parsing``); the
session, prompt-to-image and prompt-encoder tables are derived from them here. The
``input``/``output`` blocks of every ``config.pbtxt`` are written from these tables (``make
contract-configs``) and a test fails when a file differs, so a model, its parser, its config and
its clients cannot disagree. A model's kind is read from the class its ``model.py`` serves, and the
generation models a BLS model may call are derived from the repository the same way.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..contract.inputs import (
    EDIT_INPUT_SPECS,
    EDIT_OUTPUTS,
    ENCODER_OUTPUTS,
    INPUT_SPECS,
    OUTPUT_SPECS,
    STREAM_INPUT_SPECS,
    STREAM_OUTPUT_SPECS,
    THINK_INPUT_SPECS,
    THINK_TEXT_SPEC,
    TensorSpec,
)
from .prompt_parsing import PROMPT_INPUTS
from .sessions import TOKEN_INPUT

IO = tuple[dict[str, TensorSpec], dict[str, TensorSpec]]

# What the prompt-to-image model passes on to the generation model it calls, and what the encoder answers.
T2I_PASSED_INPUTS = ("SIZE", "SEED", "STEPS", "CFG_SCALE", "CFG_INTERVAL", "CFG_NORM", "TIMESTEP_SHIFT",
                     "OUTPUT_FORMAT", "LORA", "LORA_SCALE", "CACHE", "CACHE_THRESHOLD", "IMAGE_GUIDANCE_SCALE")

_PROMPT = {name: TensorSpec("TYPE_STRING", (1,), optional=name == "NEGATIVE_PROMPT") for name in PROMPT_INPUTS}
_MODEL = {"MODEL": TensorSpec("TYPE_STRING", (1,))}


def _required(name: str) -> TensorSpec:
    """An output row: the input's type and dims (outputs are never optional)."""
    return TensorSpec(INPUT_SPECS[name].data_type, INPUT_SPECS[name].dims, optional=False)


# A session turn takes the generation inputs but the noise ones (the session owns its stream), every
# prefix optional (a closing sequence_end carries none), plus MODEL and the owner's SESSION_TOKEN.
SESSION_IO: IO = (
    {**{n: TensorSpec(s.data_type, s.dims) for n, s in INPUT_SPECS.items() if n not in ("RNG_STATE", "NOISE")},
     **_MODEL, TOKEN_INPUT: TensorSpec("TYPE_STRING", (1,))},
    {"IMAGE": OUTPUT_SPECS["IMAGE"], "TURN": TensorSpec("TYPE_INT64", (1,), optional=False),
     "NEXT_RNG_STATE": OUTPUT_SPECS["NEXT_RNG_STATE"], TOKEN_INPUT: TensorSpec("TYPE_STRING", (1,), optional=False)},
)
T2I_IO: IO = ({**_PROMPT, **EDIT_INPUT_SPECS, **THINK_INPUT_SPECS, **_MODEL,
               **{n: INPUT_SPECS[n] for n in T2I_PASSED_INPUTS}},
              {"IMAGE": OUTPUT_SPECS["IMAGE"], "THINK_TEXT": THINK_TEXT_SPEC})
ENCODER_IO: IO = ({**_PROMPT, **EDIT_INPUT_SPECS, **THINK_INPUT_SPECS},
                  {**{n: _required(n) for n in (*ENCODER_OUTPUTS, *EDIT_OUTPUTS)}, "THINK_TEXT": THINK_TEXT_SPEC})

# The serving module a model.py imports its class from -> that kind's tables.
TABLES_BY_MODULE: dict[str, IO] = {
    "triton_model": (INPUT_SPECS, OUTPUT_SPECS),
    "stream_model": (STREAM_INPUT_SPECS, STREAM_OUTPUT_SPECS),
    "session_model": SESSION_IO,
    "t2i_model": T2I_IO,
    "prompt_encoder_model": ENCODER_IO,
}
_SERVED_BY = re.compile(r"^from neopp\.serving\.(\w+) import", re.MULTILINE)


def served_by(model_dir: Path) -> str | None:
    """The serving module whose class a model folder's ``1/model.py`` serves (None: not ours)."""
    path = model_dir / "1" / "model.py"
    found = _SERVED_BY.search(path.read_text()) if path.is_file() else None
    return found.group(1) if found and found.group(1) in TABLES_BY_MODULE else None


def tables_of(model_dir: Path) -> IO | None:
    module = served_by(model_dir)
    return None if module is None else TABLES_BY_MODULE[module]


def generation_models(repository: Path) -> tuple[str, ...]:
    """The plain generation models of a repository, sorted: what a BLS model calls by default."""
    return tuple(sorted(p.name for p in repository.iterdir() if p.is_dir() and served_by(p) == "triton_model"))
