"""A model's ``parameters`` from config.pbtxt, read the same way by every model of the repository."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The plain generation models (one image per request): the BLS models (sessions, prompt to image)
# call these and no others by default (their ``allowed_models`` parameter).
GENERATION_MODELS = ("neopp_dense", "neopp_dense_fp8", "neopp_dense_cfg", "neopp_dense_cfg_seq",
                     "neopp_dense_8steps", "neopp_moe", "neopp_moe_cfg")


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
