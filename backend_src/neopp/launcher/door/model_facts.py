"""What each generation model advertises (its config parameter ``neopp``), read once per model
load by the door: the sizes and step limits ``/v1/models`` lists, the playground offers, and
``/v1`` holds a request to before it is sent.

A model that advertises nothing (the prompt encoder, ``neopp_session``, a streamed twin) does not
draw for ``/v1``. The facts are kept a few seconds: a reloaded model's are read again.
"""

from __future__ import annotations

import json
import time
from typing import Any

from .errors import DoorError
from .upstream import Upstream

PARAMETER = "neopp"  # written by the model at load (neopp.serving.capabilities)
STREAM_SUFFIX = "_stream"
KEEP_S = 5.0
MAX_TEXT = 1 << 16


class ModelFacts:
    """The advertised facts per model name, from the models' configs."""

    def __init__(self, upstream: Upstream, admin_key: str | None) -> None:
        self.upstream, self.admin_key = upstream, admin_key
        self._kept: dict[str, tuple[float, dict[str, Any] | None]] = {}

    async def of(self, model: str) -> dict[str, Any] | None:
        """The model's facts; None when it advertises none (it does not draw for ``/v1``)."""
        now = time.monotonic()
        kept = self._kept.get(model)
        if kept is not None and now - kept[0] < KEEP_S:
            return kept[1]
        facts = None
        if not model.endswith(STREAM_SUFFIX):
            facts = parse(await self.upstream.config_parameter(model, PARAMETER, self.admin_key))
        if len(self._kept) > 256:  # names come from the repository, but stay bounded all the same
            self._kept.clear()
        self._kept[model] = (now, facts)
        return facts

    async def drawing(self) -> dict[str, dict[str, Any]]:
        """Every READY model that draws, with its facts."""
        found = {}
        for name in await self.upstream.ready_models(self.admin_key):
            try:
                facts = await self.of(name)
            except DoorError:  # unloaded between the index and its config
                continue
            if facts is not None:
                found[name] = facts
        return found


def parse(text: str | None) -> dict[str, Any] | None:
    """The parameter's JSON object, or None when absent or not an object."""
    if not text or len(text) > MAX_TEXT:
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("steps"), dict) else None


def max_steps(facts: dict[str, Any]) -> int | None:
    value = facts.get("steps", {}).get("max")
    return value if isinstance(value, int) else None


def default_size(facts: dict[str, Any]) -> tuple[int, int] | None:
    """The model's default size as (height, width): its ``default_size`` is ``HxW``."""
    text = facts.get("default_size")
    try:
        height, width = (int(v) for v in str(text).lower().split("x"))
    except ValueError:
        return None
    return height, width
