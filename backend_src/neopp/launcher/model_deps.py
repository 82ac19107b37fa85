"""Models a loaded model needs beside it: the model whose engine runs its requests.

A model whose config names an ``engine_model`` (a streamed twin: its plain twin loads the mode's
one engine) cannot answer without that model, so the launcher adds it to tritonserver's
``--load-model`` list.
Read from the model's config file (the layout's, with ``--model-config-name``) with a pattern:
the launcher imports nothing of the serving package.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

LOAD = "--load-model="
CONFIG_NAME = "--model-config-name="
_ENGINE_MODEL = re.compile(r'key:\s*"engine_model"\s*value:\s*\{\s*string_value:\s*"([a-z][a-z0-9_]*)"')


def engine_model(repository: Path, model: str, config_name: str = "") -> str | None:
    """The engine model ``model``'s config names, if any."""
    folder = repository / model
    path = folder / "configs" / f"{config_name}.pbtxt" if config_name else folder / "config.pbtxt"
    if not path.is_file():
        path = folder / "config.pbtxt"
    try:
        text = path.read_text()
    except OSError:
        return None
    text = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    match = _ENGINE_MODEL.search(text)
    return match.group(1) if match else None


def with_engine_models(args: Sequence[str], repository: Path) -> list[str]:
    """``args`` with ``--load-model=<engine model>`` for each loaded model whose engine model is in
    the repository and not loaded already (the wildcard ``*`` loads everything anyway)."""
    config_name = next((a[len(CONFIG_NAME):] for a in args if a.startswith(CONFIG_NAME)), "")
    loaded = {a[len(LOAD):] for a in args if a.startswith(LOAD)}
    out = list(args)
    for model in [a[len(LOAD):] for a in args if a.startswith(LOAD)]:
        host = engine_model(repository, model, config_name)
        if host and host not in loaded and "*" not in loaded and (repository / host).is_dir():
            out.append(LOAD + host)
            loaded.add(host)
    return out
