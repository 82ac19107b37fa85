"""What each generation model advertises, read by the door from Triton's metrics port (each model
publishes them at load, ``neopp.contract.published_facts``): the sizes and step limits
``/v1/models`` lists, the playground offers, and ``/v1`` holds a request to before it is sent,
and the adapters the model judged it takes (``loras``, the first ``LISTED`` names, and
``loras_total``). A list whose names disagree with its count is one caught mid-update: the last
complete one stays.

A model that publishes nothing (the prompt encoder, ``neopp_session``, a streamed twin) does not
draw for ``/v1``. A door without Triton's metrics port (one started on its own, in front of a
server it did not launch) falls back to the models' metadata: a model that takes ``COND_KV``
draws, and advertises nothing. The facts are kept a few seconds: a reloaded model's are read again.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ...contract.adapter_names import LISTED, is_name
from ...contract.published_facts import ADAPTER_METRIC, ADAPTERS_METRIC
from ...contract.sizes import openai_size
from . import triton_metrics
from .door_error import DoorError
from .upstream import Upstream

STREAM_SUFFIX = "_stream"
KEEP_S = 5.0
MAX_TEXT = 1 << 16


class ModelFacts:
    """The advertised facts per model name."""

    def __init__(self, upstream: Upstream, admin_key: str | None,
                 metrics_address: tuple[str, int] | None = None) -> None:
        self.upstream, self.admin_key, self.metrics_address = upstream, admin_key, metrics_address
        self._read_at, self._published = -KEEP_S, {}
        self._adapters: dict[str, tuple[list[str], int]] = {}  # model -> (names, total), each complete

    async def _all(self) -> dict[str, str]:
        if time.monotonic() - self._read_at >= KEEP_S:
            text = await triton_metrics.fetch(self.metrics_address)
            if text:  # no answer: the last complete facts stay
                self._published = triton_metrics.capabilities(text)
                self._adapters = {model: listing for model, listing in self._adapters.items()
                                  if model in self._published}
                self._adapters.update(complete_adapter_lists(text))
            self._read_at = time.monotonic()
        return self._published

    async def of(self, model: str) -> dict[str, Any] | None:
        """The model's facts ({}: it draws, advertising nothing); None when it does not draw."""
        if model.endswith(STREAM_SUFFIX):
            return None
        published = await self._all()
        if published:
            facts = parse(published.get(model))
            if facts is not None:
                names, total = self._adapters.get(model, ([], 0))
                facts.update(loras=names, loras_total=total)
            return facts
        metadata = await self.upstream.metadata(model, "")
        return {} if any(item.name == "COND_KV" for item in metadata.inputs) else None

    async def drawing(self) -> dict[str, dict[str, Any]]:
        """Every READY model that draws, with its facts."""
        found = {}
        for name in await self.upstream.ready_models(self.admin_key):
            try:
                facts = await self.of(name)
            except DoorError:  # unloaded between the index and its metadata
                continue
            if facts is not None:
                found[name] = facts
        return found


def complete_adapter_lists(text: str) -> dict[str, tuple[list[str], int]]:
    """{model: (the first LISTED names on offer, sorted; their count)} of each model whose lines
    agree: as many names on offer as its count says (up to LISTED)."""
    totals = triton_metrics.samples(text, {ADAPTERS_METRIC: "total"})
    lines = triton_metrics.by_label(text, ADAPTER_METRIC, "adapter")
    found = {}
    for model, fields in totals.items():
        total = int(fields["total"])
        names = sorted(name for name, value in lines.get(model, {}).items() if value == 1.0 and is_name(name))
        if len(names) == min(total, LISTED):
            found[model] = (names, total)
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
    """The model's default size as (height, width): its ``default_size`` is ``WxH``, as OpenAI's."""
    try:
        return openai_size(str(facts.get("default_size")))
    except ValueError:
        return None
