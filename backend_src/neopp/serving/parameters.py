"""A model's ``parameters`` from config.pbtxt, read the same way by every model of the repository."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .model_io import generation_models


def read_parameters(model_config: Mapping[str, Any], defaults: Mapping[str, str]) -> dict[str, str]:
    """The parameters as plain strings (Triton wraps each in ``string_value``), ``defaults`` filled in."""
    params = dict(defaults)
    for key, value in (model_config.get("parameters") or {}).items():
        params[key] = str(value.get("string_value", "")) if isinstance(value, dict) else str(value)
    return params


def narrow_kv_dims(entry: dict[str, Any], kv_dims: list[int]) -> None:
    """Set a KV tensor's declared dims to the checkpoint's, in place (add_input/add_output refuse to
    change declared dims); declared dims that contradict the checkpoint are a deployment error."""
    dims = [int(d) for d in entry.get("dims", [])]
    if len(dims) not in (0, 5) or any(d not in (-1, k) for d, k in zip(dims, kv_dims)):
        raise ValueError(f"{entry['name']}: config.pbtxt dims {dims} contradict the checkpoint's {kv_dims}")
    entry["dims"] = kv_dims


def model_allowlist(params: Mapping[str, str], model_dir: str | Path) -> tuple[tuple[str, ...], str]:
    """The models a BLS model may call and its default, checked once at load. ``allowed_models``
    unset: the plain generation models of the repository holding ``model_dir``."""
    allowed = tuple(m.strip() for m in params["allowed_models"].split(",") if m.strip())
    allowed = allowed or generation_models(Path(model_dir).parent)
    default = params["default_model"].strip()
    if default not in allowed:
        raise ConfigError(f"parameter default_model: {default!r} is not in allowed_models {allowed}")
    return allowed, default
