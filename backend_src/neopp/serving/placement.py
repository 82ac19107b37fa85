"""Which GPUs a model's instances use, and whether the models of one layout collide.

A layout is a set of Triton custom model configurations of one name
(``model_repository/<model>/configs/<name>.pbtxt``, chosen with ``--model-config-name``); a model
without that file falls back to its ``config.pbtxt``. GPUs are named in a config in two ways:

* a 1-process mode: ``instance_group [{ kind: KIND_GPU count: 1 gpus: [N] }]`` (Triton places it);
* a mode with several ranks: a ``KIND_MODEL`` group and the parameter ``gpus: "0,1,..."``, one
  GPU per rank of the model's one engine (its other instances only hand requests to it).

Each model only sees its own config at load, so it reads its siblings' configs of the same layout
(parameter ``layout``, the config's name) from the repository and refuses to load when their GPUs
overlap, unless both declare ``share_gpus: "true"``. Everything here is a pure function of the
configs and a device count, so the rules are testable without GPUs. Configs naming no GPU keep the
automatic placement (``choose_device``), which loads on any machine.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

TRUE = ("1", "true", "yes", "on")
_TOKEN = re.compile(r'\s+|#[^\n]*|"(?:[^"\\\n]|\\.)*"|[{}\[\]<>:,;]|[^\s{}\[\]<>:,;"#]+')


@dataclass(frozen=True)
class Placement:
    """The GPUs one model's config names: one tuple per instance (``()``: none named)."""

    model: str
    instances: tuple[tuple[int, ...], ...]
    share: bool = False

    @property
    def gpus(self) -> frozenset[int]:
        return frozenset(g for instance in self.instances for g in instance)


def parse_gpu_list(text: str) -> tuple[int, ...]:
    """``"0, 1"`` -> ``(0, 1)``; a GPU named twice would put two ranks on one device."""
    try:
        gpus = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError as exc:
        raise ConfigError(f"parameter gpus: {text!r} is not a comma-separated list of GPU indices") from exc
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise ConfigError(f"parameter gpus: {text!r} must name distinct non-negative GPU indices")
    return gpus


def instance_slices(gpus: tuple[int, ...], world_size: int, instances: int) -> tuple[tuple[int, ...], ...]:
    """Instance ``i`` gets ``gpus[i*w:(i+1)*w]``; the list must fill every instance exactly, so no
    GPU in a layout is named without being used."""
    if world_size < 1 or instances < 1:
        raise ConfigError(f"placement needs a positive world size and instance count, got {world_size}, {instances}")
    if len(gpus) % world_size:
        raise ConfigError(f"parameter gpus: {len(gpus)} GPUs {list(gpus)} are not a multiple of the "
                          f"{world_size} ranks of one instance")
    if len(gpus) != world_size * instances:
        raise ConfigError(f"parameter gpus: {len(gpus)} GPUs {list(gpus)} give {len(gpus) // world_size} engine(s) "
                          f"of {world_size} ranks, but a model runs {instances}")
    return tuple(gpus[i * world_size:(i + 1) * world_size] for i in range(instances))


def _param(config: Mapping[str, Any], key: str) -> str:
    value = (config.get("parameters") or {}).get(key, "")
    return str(value.get("string_value", "")) if isinstance(value, Mapping) else str(value)


def _groups(config: Mapping[str, Any]) -> list[tuple[str, int, tuple[int, ...]]]:
    """(kind, count, gpus) per instance group, with Triton's defaults (KIND_AUTO, count 1)."""
    return [(str(g.get("kind") or "KIND_AUTO"), int(g.get("count") or 1), tuple(int(x) for x in g.get("gpus") or ()))
            for g in config.get("instance_group") or [{}]]


def _check_visible(model: str, gpus: frozenset[int], device_count: int) -> None:
    if gpus and device_count == 0:
        raise ConfigError(f"{model}: the config places it on GPUs {sorted(gpus)} but CUDA is not available; "
                          "load the default config on machines without GPUs")
    missing = sorted(g for g in gpus if g >= device_count)
    if missing:
        raise ConfigError(f"{model}: the config names GPUs {missing} but only {device_count} are visible")


def _gpu_groups(model: str, groups: list[tuple[str, int, tuple[int, ...]]], world_size: int,
                device_count: int) -> tuple[tuple[int, ...], ...]:
    """Triton's own KIND_GPU placement: ``count`` instances on each listed GPU (all when none)."""
    if world_size != 1:
        raise ConfigError(f"{model}: KIND_GPU places one process per instance; a mode with {world_size} ranks "
                          'needs a KIND_MODEL group and the parameter gpus (e.g. "0,1")')
    out: list[tuple[int, ...]] = []
    for kind, count, gpus in groups:
        if kind == "KIND_GPU" or (kind == "KIND_AUTO" and device_count):
            out += [(g,) for g in (gpus or tuple(range(device_count))) for _ in range(count)]
    return tuple(out)


def model_placement(config: Mapping[str, Any], world_size: int, device_count: int) -> Placement:
    """The GPUs ``config`` names for each instance, checked against ``device_count`` visible GPUs."""
    model = str(config.get("name", "?"))
    groups, listed = _groups(config), _param(config, "gpus").strip()
    share = _param(config, "share_gpus").strip().lower() in TRUE
    if any(kind == "KIND_GPU" for kind, _, _ in groups) and listed:
        raise ConfigError(f"{model}: name GPUs either in a KIND_GPU group or in the parameter gpus, not both")
    if listed:
        if len(groups) != 1:
            raise ConfigError(f"{model}: the parameter gpus needs exactly one instance group, got {len(groups)}")
        instances = instance_slices(parse_gpu_list(listed), world_size, 1)  # the one engine's ranks
    elif any(kind == "KIND_GPU" or (kind == "KIND_AUTO" and device_count) for kind, _, _ in groups):
        instances = _gpu_groups(model, groups, world_size, device_count)
    else:
        return Placement(model, (), share)
    placement = Placement(model, instances, share)
    _check_visible(model, placement.gpus, device_count)
    return placement


def check_overlaps(placements: list[Placement], layout: str) -> None:
    """Refuse two models on one GPU unless both declare ``share_gpus``: co-loaded models would
    otherwise compete for memory and compute without anyone having chosen it."""
    for i, a in enumerate(placements):
        for b in placements[i + 1:]:
            common = sorted(a.gpus & b.gpus)
            if common and not (a.share and b.share):
                raise ConfigError(f"{a.model} and {b.model} both use GPUs {common} in layout {layout or 'default'}; "
                                  'give them disjoint GPUs or set share_gpus: "true" on both')


def backend_devices(placement: Placement, instance_kind: str, instance_index: int) -> tuple[str, list[int]] | None:
    """(device of rank 0, the model's whole GPU list) for an instance the backend places itself;
    the rank pool takes slice ``instance_index`` of that list again. None where Triton placed the
    instance (KIND_GPU) or the config names no GPU (the automatic rule applies)."""
    if not placement.gpus or instance_kind.upper().endswith("GPU"):
        return None
    if not 0 <= instance_index < len(placement.instances):
        raise ConfigError(f"{placement.model}: instance {instance_index} has no GPUs in the layout "
                          f"({len(placement.instances)} instance slices)")
    return f"cuda:{placement.instances[instance_index][0]}", [g for gpus in placement.instances for g in gpus]


# ---------------------------------------------------------------- the sibling configs on disk

def tokenize(text: str) -> list[str]:
    """Protobuf text format tokens, comments and blanks dropped."""
    tokens, pos = [], 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ConfigError(f"config: cannot read the text at {text[pos:pos + 30]!r}")
        pos = match.end()
        token = match.group(0)
        if not token.isspace() and not token.startswith("#"):
            tokens.append(token)
    return tokens


def _value(tokens: list[str], pos: int) -> tuple[Any, int]:
    token = tokens[pos]
    if token in ("{", "<"):
        return _message(tokens, pos + 1, "}" if token == "{" else ">")
    if token.startswith('"'):
        return ast.literal_eval(token), pos + 1
    return token, pos + 1


def _message(tokens: list[str], pos: int, end: str | None) -> tuple[dict[str, list[Any]], int]:
    """Fields of one message: name -> every value given (repeated fields and lists flattened)."""
    fields: dict[str, list[Any]] = {}
    while pos < len(tokens) and tokens[pos] != end:
        name, pos = tokens[pos], pos + 1
        pos += tokens[pos] == ":"
        if tokens[pos] == "[":
            pos += 1
            while tokens[pos] != "]":
                value, pos = _value(tokens, pos)
                fields.setdefault(name, []).append(value)
                pos += tokens[pos] == ","
            pos += 1
        else:
            value, pos = _value(tokens, pos)
            fields.setdefault(name, []).append(value)
        pos += pos < len(tokens) and tokens[pos] in (",", ";")
    if end is not None and pos >= len(tokens):
        raise ConfigError(f"config: a message is not closed with {end!r}")
    return fields, pos + (end is not None)


def read_placement_fields(text: str) -> dict[str, Any]:
    """The fields placement needs (name, instance_group, parameters) from a config.pbtxt, shaped
    like the JSON config Triton hands a model. Parsed here: the runtime must not need tritonclient."""
    try:
        fields, _ = _message(tokenize(text), 0, None)
    except IndexError as exc:
        raise ConfigError("config: the text ends in the middle of a field") from exc
    first = lambda f, key, default: f.get(key, [default])[0]  # noqa: E731
    groups = [{"kind": first(g, "kind", "KIND_AUTO"), "count": int(first(g, "count", 1)),
               "gpus": [int(x) for x in g.get("gpus", [])]} for g in fields.get("instance_group", [])]
    params = {first(p, "key", ""): {"string_value": first(first(p, "value", {}), "string_value", "")}
              for p in fields.get("parameters", [])}
    return {"name": first(fields, "name", ""), "instance_group": groups, "parameters": params}


def sibling_configs(repository: Path, layout: str) -> dict[str, dict[str, Any]]:
    """Each model's config of ``layout`` in ``repository`` (its config.pbtxt when it has none), as
    Triton would choose it."""
    out = {}
    for folder in sorted(p for p in repository.iterdir() if (p / "config.pbtxt").is_file()):
        custom = folder / "configs" / f"{layout}.pbtxt"
        path = custom if layout and custom.is_file() else folder / "config.pbtxt"
        try:
            config = read_placement_fields(path.read_text())
        except ConfigError as exc:
            raise ConfigError(f"{folder.name}/{path.relative_to(folder)}: {exc}") from exc
        config["name"] = config["name"] or folder.name
        out[folder.name] = config
    return out


def check_layout(own: Mapping[str, Any], model_dir: Path, world_size: int, device_count: int) -> Placement:
    """This model's placement, refused when a sibling model of the same layout shares its GPUs.

    Siblings naming no GPU in the layout are a risk only where they would take GPUs automatically:
    a generation model (it has a ``mode_file``) not pinned to ``device: cpu`` is refused too; a
    front (it names an ``engine_model``) loads nothing and is left out."""
    placement = model_placement(own, world_size, device_count)
    if not placement.gpus:
        return placement
    layout = _param(own, "layout").strip()
    if layout and not (model_dir / "configs" / f"{layout}.pbtxt").is_file():
        raise ConfigError(f"{placement.model}: parameter layout {layout!r} but configs/{layout}.pbtxt does not exist")
    others = [placement]
    for folder, config in sibling_configs(model_dir.parent, layout).items():
        if folder == model_dir.name:
            continue
        if _param(config, "engine_model").strip():
            continue  # a front: it loads no weights, its engine model holds its GPUs
        sibling = _sibling_placement(config, device_count)
        if not sibling.gpus and _param(config, "mode_file") and _param(config, "device").strip().lower() != "cpu":
            raise ConfigError(f"{placement.model}: {folder} names no GPUs in layout {layout or 'default'} and would "
                              f"take them automatically; give it configs/{layout or 'NAME'}.pbtxt with its GPUs")
        others.append(sibling)
    check_overlaps(others, layout)
    return placement


def _sibling_placement(config: Mapping[str, Any], device_count: int) -> Placement:
    """A sibling's GPUs; only their union matters here, so a listed set is one instance of all ranks."""
    model = str(config.get("name", "?"))
    listed = _param(config, "gpus").strip()
    share = _param(config, "share_gpus").strip().lower() in TRUE
    if listed:
        return Placement(model, (parse_gpu_list(listed),), share)
    groups = _groups(config)
    return Placement(model, tuple((g,) for kind, _, gpus in groups if kind == "KIND_GPU"
                                  for g in (gpus or range(device_count))), share)
