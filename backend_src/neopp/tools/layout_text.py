"""The text of one layout file: the model's ``config.pbtxt`` with only what a layout may change.

A layout file differs from its config.pbtxt in its header, its instance group (with the comment
above it) and the placement parameters (``layout``, ``gpus``, ``share_gpus``, ``device: "cpu"`` for
a model the layout does not serve); inputs, outputs, queue policy and every other parameter are
copied, so a layout never falls behind its model's config (a test compares them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError

GPU_INSTANCES = 8  # requests a GPU model's instances hand to its one engine at once
_GROUP = re.compile(r"^instance_group \[.*\]$")
_DEVICE = re.compile(r'^(\s*\{ key: "device" value: \{ string_value: )"[^"]*"( \} \},?.*)$')


@dataclass(frozen=True)
class FileSpec:
    """What one model's file of the layout says."""

    layout: str
    header: tuple[str, ...]  # comment lines naming the layout and how it was written
    gpus: tuple[int, ...] = ()  # one per rank; () with no reason: a front of a served engine
    reason: str = ""  # why the layout does not serve it
    share_with: tuple[str, ...] = ()
    engine: str = ""  # a front's engine model


def _param(key: str, value: str, note: str = "") -> str:
    return f'  {{ key: "{key}" value: {{ string_value: "{value}" }} }},' + (f"  # {note}" if note else "")


def _group(spec: FileSpec, base_group: str) -> list[str]:
    """The instance group and the comment that says why."""
    world = len(spec.gpus)
    if spec.reason:
        return [f"# Not served in this layout: {spec.reason}.",
                "# Pinned to the CPU so that it can never take a GPU automatically; do not load it with",
                "# real weights on this node.", base_group]
    if spec.engine:
        return [f"# A front holds no weights: one instance hands every stream to {spec.engine}'s engine.", base_group]
    if world == 1:
        return [f"# Triton places the instances on GPU {spec.gpus[0]}; the first loads the mode's engine there and",
                "# every one hands its requests to it (docs/performance.md): the count is how many run at once.",
                f"instance_group [ {{ kind: KIND_GPU count: {GPU_INSTANCES} gpus: [ {spec.gpus[0]} ] }} ]"]
    listed = ",".join(str(g) for g in spec.gpus)
    return [f"# KIND_MODEL: the backend places the engine's {world} ranks itself, on the GPUs of the parameter",
            f"# gpus ({listed}); every instance hands its requests to that engine (docs/performance.md).",
            f"instance_group [ {{ kind: KIND_MODEL count: {GPU_INSTANCES} }} ]"]


def render(base: str, spec: FileSpec) -> str:
    """``base`` (a config.pbtxt) as the file of ``spec.layout``."""
    lines = base.splitlines()
    group = [i for i, line in enumerate(lines) if _GROUP.match(line)]
    device = [i for i, line in enumerate(lines) if _DEVICE.match(line)]
    if len(group) != 1 or len(device) != 1:
        raise ConfigError(f"config.pbtxt: a layout needs one single-line instance_group and one device parameter "
                          f"(found {len(group)} and {len(device)})")
    top = group[0]
    while top > 0 and lines[top - 1].startswith("#"):
        top -= 1  # the comment above the group describes it: replaced with the layout's
    params = [_param("layout", spec.layout)]
    if spec.gpus and len(spec.gpus) > 1:
        params.append(_param("gpus", ",".join(str(g) for g in spec.gpus)))
    if spec.share_with:
        params.append(_param("share_gpus", "true", "with " + ", ".join(spec.share_with)))
    device_line = lines[device[0]]
    if spec.reason:
        device_line = _DEVICE.sub(r'\1"cpu"\2', device_line)
    out = (list(spec.header) + lines[:top] + _group(spec, lines[group[0]]) + lines[group[0] + 1:device[0]]
           + params + [device_line] + lines[device[0] + 1:])
    return "\n".join(out) + "\n"
