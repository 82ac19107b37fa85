"""A server's adapter directory and the adapters resident in one model's process.

``AdapterDirectory`` lists ``<name>.safetensors`` files of one folder and reads what an adapter
recommends (sampling values) without loading its tensors; a request only ever names an
adapter, and a name is a plain file stem, never a path. ``AdapterStore`` loads an adapter on
first use, fitted to the model's own linears, and keeps the resident ones in an LRU bounded by
bytes: an adapter that does not fit, or a malformed file, is refused with the key at fault and
leaves the model as it was.
"""

from __future__ import annotations

import json
import math
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError, InputError, shown
from ..modes import SamplingParams

NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SUFFIX = ".safetensors"
METADATA_KEY = "neopp_sampling"  # safetensors metadata: a JSON object of recommended sampling values
MAX_HEADER_BYTES = 64 << 20      # a safetensors header larger than this is refused unread
MAX_SIDECAR_BYTES = 64 << 10
# Sampling values an adapter may recommend (an 8-step adapter: 8 steps, guidance off).
RECOMMENDABLE = ("infer_steps", "cfg_scale", "timestep_shift", "cfg_interval", "enable_cfg")
DEFAULT_MAX_BYTES = 1 << 30
LORA_SCALE_MAX_ABS = 8.0  # an adapter is trained at 1; far beyond, the image is noise


def check_name(name: str) -> str:
    """An adapter name: letters, digits, ``.``, ``_``, ``-``, at most 128, not starting with a dot."""
    if not isinstance(name, str) or not NAME_RULE.fullmatch(name) or ".." in name:
        raise InputError(f"LORA: {shown(name)} is not an adapter name (letters, digits, '.', '_', '-'; "
                         "at most 128, starting with a letter or digit)")
    return name


def lora_inputs(name: str | None, scale: Any) -> tuple[str, float]:
    """A request's ``LORA`` (a name, never a path) and ``LORA_SCALE`` (default 1.0)."""
    if name is None:
        raise InputError("LORA_SCALE: given without LORA (name the adapter it scales)")
    check_name(name)
    value = 1.0 if scale is None else float(getattr(scale, "reshape", lambda _: [scale])(-1)[0])
    if not math.isfinite(value) or abs(value) > LORA_SCALE_MAX_ABS:
        raise InputError(f"LORA_SCALE: must be a finite number within -{LORA_SCALE_MAX_ABS:g}..{LORA_SCALE_MAX_ABS:g}, "
                         f"got {shown(value)}")
    return name, value


def safetensors_metadata(path: Path) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file, read from its header alone (no tensor)."""
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise ConfigError(f"LoRA {path}: not a safetensors file (shorter than its header length)")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER_BYTES:
            raise ConfigError(f"LoRA {path}: header of {size} bytes is over the limit of {MAX_HEADER_BYTES}")
        try:
            header = json.loads(handle.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"LoRA {path}: header is not JSON ({exc})") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def recommended_values(raw: Any, where: str) -> dict[str, Any]:
    """The recommendable sampling values of a JSON object, checked (``SamplingParams``' rules)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: recommended sampling values must be a JSON object")
    unknown = sorted(set(raw) - set(RECOMMENDABLE))
    if unknown:
        raise ConfigError(f"{where}: key '{unknown[0]}' is not a recommendable sampling value {RECOMMENDABLE}")
    values = {k: (tuple(v) if k == "cfg_interval" and isinstance(v, list) else v) for k, v in raw.items()}
    try:
        SamplingParams().replace(**values)
    except (InputError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return values


class AdapterDirectory:
    """One folder of adapters (``None``: a server without one, which offers none)."""

    def __init__(self, folder: str | Path | None) -> None:
        self.folder = None if folder is None or str(folder) == "" else Path(folder)

    def names(self) -> list[str]:
        """The adapters on offer, sorted (files whose stem is a valid name)."""
        if self.folder is None or not self.folder.is_dir():
            return []
        return sorted(p.name[: -len(SUFFIX)] for p in self.folder.glob("*" + SUFFIX)
                      if NAME_RULE.fullmatch(p.name[: -len(SUFFIX)]) and ".." not in p.name and p.is_file())

    def path(self, name: str) -> Path:
        """The file of adapter ``name``; InputError naming LORA when there is none."""
        check_name(name)
        path = None if self.folder is None else self.folder / (name + SUFFIX)
        if path is None or not path.is_file():
            offered = self.names()
            raise InputError(f"LORA: no adapter named {shown(name)} on this model; "
                             f"offered: {offered if offered else 'none (no adapter directory)'}")
        return path

    def recommended(self, name: str) -> dict[str, Any]:
        """Sampling values the adapter recommends: its sidecar ``<name>.json`` (key ``sampling``, or
        the object itself), else its safetensors metadata ``neopp_sampling``; {} when neither."""
        path = self.path(name)
        sidecar = path.with_name(name + ".json")
        if sidecar.is_file():
            if sidecar.stat().st_size > MAX_SIDECAR_BYTES:
                raise ConfigError(f"LoRA {sidecar}: over {MAX_SIDECAR_BYTES} bytes")
            try:
                raw = json.loads(sidecar.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ConfigError(f"LoRA {sidecar}: not JSON ({exc})") from None
            raw = raw.get("sampling", raw) if isinstance(raw, dict) else raw
            return recommended_values(raw, f"LoRA {sidecar}")
        text = safetensors_metadata(path).get(METADATA_KEY)
        if text is None:
            return {}
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"LoRA {path}: metadata key '{METADATA_KEY}' is not JSON ({exc})") from None
        return recommended_values(raw, f"LoRA {path}: metadata key '{METADATA_KEY}'")


def adapter_sampling(directory: AdapterDirectory, name: str, defaults: SamplingParams,
                     overrides: Mapping[str, Any]) -> SamplingParams:
    """A request's sampling values under adapter ``name`` (``apply_recommended``); a sidecar or
    metadata that cannot be read refuses the request, naming LORA and the key."""
    try:
        recommended = directory.recommended(name)
    except (ConfigError, OSError) as exc:
        raise InputError(f"LORA: adapter {name!r} refused: {exc}") from None
    return apply_recommended(defaults, overrides, recommended)


def apply_recommended(defaults: SamplingParams, overrides: Mapping[str, Any],
                      recommended: Mapping[str, Any]) -> SamplingParams:
    """The request's sampling values: its own overrides, then the adapter's recommendations for
    what it left unset, then the model's defaults. Guidance off (``enable_cfg``) is recommended
    only to a request that sets no guidance value of its own."""
    guided = any(k in overrides for k in ("cfg_scale", "cfg_interval"))
    taken = {k: v for k, v in recommended.items() if k not in overrides and not (k == "enable_cfg" and guided)}
    return defaults.replace(**taken, **overrides)


def file_stamp(path: Path) -> tuple[int, int]:
    """(modification time in ns, size): what tells a file replaced in place."""
    info = path.stat()
    return info.st_mtime_ns, info.st_size


class AdapterStore:
    """Adapters resident in one model's process: loaded on first use, least recently used evicted
    while their bytes exceed ``max_bytes`` (an adapter bigger than the bound alone is refused).

    ``load`` is given the adapter's name and path and builds it (fitted to the tower); a request
    that holds an adapter keeps it alive even once evicted.
    """

    def __init__(self, directory: AdapterDirectory, load: Any, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes <= 0:
            raise ConfigError(f"parameter lora_max_bytes: must be positive, got {max_bytes}")
        self.directory, self._load, self.max_bytes = directory, load, max_bytes
        self._resident: OrderedDict[str, Any] = OrderedDict()
        self._stamps: dict[str, tuple[int, int]] = {}  # each resident adapter's file when it loaded
        self._lock = threading.Lock()

    def get(self, name: str) -> Any:
        """The adapter ``name``, loaded if it is not resident or its file changed since (a file
        replaced in place is read again; a removed one is refused and dropped); InputError naming LORA."""
        try:
            stamp = file_stamp(self.directory.path(name))
        except (InputError, OSError) as exc:
            self.unload(name)
            if isinstance(exc, InputError):
                raise
            raise InputError(f"LORA: adapter {name!r} refused: {exc}") from None
        with self._lock:
            if name in self._resident and self._stamps.get(name) == stamp:
                self._resident.move_to_end(name)
                return self._resident[name]
        return self.reload(name)

    def reload(self, name: str) -> Any:
        """Read ``name`` from its file again (replacing a resident copy only once it loaded)."""
        path = self.directory.path(name)
        try:
            stamp = file_stamp(path)
            adapter = self._load(name, path, self.directory.recommended(name))
        except (ConfigError, OSError) as exc:
            raise InputError(f"LORA: adapter {name!r} refused: {exc}") from None
        if adapter.nbytes > self.max_bytes:
            raise InputError(f"LORA: adapter {name!r} takes {adapter.nbytes} bytes, over this model's adapter "
                             f"memory bound of {self.max_bytes} (parameter lora_max_bytes)")
        with self._lock:
            self._resident.pop(name, None)
            self._resident[name], self._stamps[name] = adapter, stamp
            while sum(a.nbytes for a in self._resident.values()) > self.max_bytes:
                self._stamps.pop(self._resident.popitem(last=False)[0], None)
        return adapter

    def unload(self, name: str) -> bool:
        """Drop ``name`` from the resident set; False when it was not resident."""
        with self._lock:
            self._stamps.pop(name, None)
            return self._resident.pop(name, None) is not None

    def resident(self) -> dict[str, int]:
        """Resident adapters' bytes, least recently used first."""
        with self._lock:
            return {name: a.nbytes for name, a in self._resident.items()}
