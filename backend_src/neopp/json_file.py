"""Reading the project's JSON files (checkpoint config, mode files) with one set of errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ConfigError


def read_json_object(path: str | Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; a missing file, bad JSON or another type is a ConfigError naming ``what``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} {path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {path}: must hold a JSON object, got {type(raw).__name__}")
    return raw
