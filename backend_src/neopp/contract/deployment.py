"""Where a deployment's files are: a model's path setting, overridden from the environment.

The stub resolves its checkpoint and adapter folder this way, and the door lists a model's
adapters from the same folder, so both read the override here: ``<PREFIX>_<MODEL>`` (the model's
name upper-cased, every other character ``_``), then ``<PREFIX>``, then the model's parameter.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

CHECKPOINT_ENV = "NEOPP_CHECKPOINT"
LORA_DIR_ENV = "NEOPP_LORA_DIR"


def model_env_var(prefix: str, model_name: str) -> str:
    """The per-model override of a setting: ``<prefix>_<MODEL NAME UPPER>``."""
    return prefix + "_" + re.sub(r"[^A-Za-z0-9]", "_", model_name).upper()


def env_override(env: Mapping[str, str], prefix: str, model_name: str) -> str | None:
    """The model's own variable, else the server-wide one; None when neither is set."""
    for var in (model_env_var(prefix, model_name), prefix):
        if env.get(var):
            return env[var]
    return None
