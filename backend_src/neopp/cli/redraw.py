"""``neopp generate --from FILE``: draw again what a picture's record says it was drawn with.

The record (written by the server into every picture it serves) gives the model, the size, the
steps, the guidance, the seed, the adapter, the step cache and think mode; what the command line
gives as well replaces the record's value. The same request draws the same bytes, so a redraw of
a picture with its seed is that picture again. A record without the prompt (the server keeps
prompts only where its operator allows) needs the prompt on the command line.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..contract.picture_record import MAX_PICTURE_BYTES, RecordError, read_record
from .client import CliError
from .generate import Ask


def picture_record(path: Path) -> dict[str, Any]:
    """The record of the picture file at ``path``; a file without one is a usage error in words."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_PICTURE_BYTES + 1)  # a device or a pipe reports no size: read at most this
    except OSError as exc:
        raise CliError(f"--from {path}: cannot read the picture ({exc.strerror or exc})", 2) from None
    if len(data) > MAX_PICTURE_BYTES:
        raise CliError(f"--from {path}: over the {MAX_PICTURE_BYTES} bytes a picture read for its record may hold", 2)
    try:
        return read_record(data)
    except RecordError as exc:
        raise CliError(f"--from {path}: {exc}", 2) from None


def redraw_ask(ns: argparse.Namespace, record: dict[str, Any], ask: Ask) -> Ask:
    """``ask`` (what the command line said) with every value it left out taken from ``record``."""
    source = f"--from {ns.from_file}"
    editing = bool(ask.images)
    if record.get("edit", False) != editing:
        raise CliError(f"{source}: the picture {'was' if record.get('edit') else 'was not'} an edit; redraw it "
                       f"with `neopp {'edit IMAGE ...' if record.get('edit') else 'generate'} --from`", 2)
    if record.get("resize"):
        raise CliError(f"{source}: the picture was resized by its request to {record['resize']} (RESIZE), "
                       "which this command does not ask for", 2)
    prompt = ask.prompt or record.get("prompt")
    if not prompt:
        why = ("its prompts did not fit in the file's metadata" if record.get("prompts_omitted") else
               "the server keeps prompts only where its operator allows")
        raise CliError(f"{source}: its record holds no prompt ({why}): give the prompt too", 2)
    seed = ask.seed if ask.seed is not None else record["seed"]
    if isinstance(seed, str):
        why = "continued a noise stream" if seed == "stream" else "started from noise its client sent"
        raise CliError(f"{source}: the picture {why}, so no seed draws it again; give --seed to draw it anew", 2)
    taken = {
        "prompt": prompt, "seed": seed, "model": ask.model or record["model"],
        "size": ask.size or f"{record['width']}x{record['height']}", "steps": _given(ask.steps, record["steps"]),
        "guidance": _given(ask.guidance, record["guidance_scale"]),
        "negative_prompt": _given(ask.negative_prompt, record.get("negative_prompt")),
        "lora": ask.lora or ((record["lora"], record.get("lora_scale")) if record.get("lora") else None),
        "cache": ask.cache or _cache(record), "think": _given(ask.think, _think(record)),
        "cfg_norm": ask.cfg_norm or record.get("guidance_norm"), "shift": _given(ask.shift, record["timestep_shift"]),
        "cfg_interval": ask.cfg_interval or _pair(record.get("guidance_interval")),
    }
    if editing:
        taken["image_guidance"] = _given(ask.image_guidance, record.get("image_guidance_scale"))
    return replace(ask, **taken)


def _given(value: Any, recorded: Any) -> Any:
    return recorded if value is None else value


def _cache(record: dict[str, Any]) -> tuple[str, float | None] | None:
    method = record.get("cache")
    return None if method in (None, "off") else (method, record.get("cache_threshold"))


def _think(record: dict[str, Any]) -> int | None:
    return (record.get("think_max_tokens") or 0) if record.get("think") else None


def _pair(value: Any) -> tuple[float, float] | None:
    return None if value is None else (float(value[0]), float(value[1]))
