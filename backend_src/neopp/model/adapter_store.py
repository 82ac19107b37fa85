"""A server's adapter directory and the adapters resident in one model's process.

``AdapterDirectory`` lists ``<name>.safetensors`` files of one folder (``neopp.contract.adapter_names``)
and reads what an adapter recommends (sampling values), judging its header on the way, without
reading its factors; a request only ever names an adapter, and a name is a plain file stem,
never a path. ``AdapterStore`` loads an adapter on first use, fitted to the model's own linears,
and keeps the resident ones in an LRU bounded by bytes: an adapter that does not fit, or a
malformed file, is refused by name with the rule it broke and leaves the model as it was. Both
remember a refusal by the file's stamp, so a bad file costs one read, not one per request.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..contract.adapter_names import (
    LISTED,
    MAX_NAME_CHARS,
    REFUSAL_LISTED,
    SCALE_MAX_ABS,
    Listing,
    adapter_file,
    is_name,
    list_adapters,
)
from ..errors import ConfigError, InputError, shown
from ..modes import SamplingParams
from .safetensors_header import FileChanged, check_size, read_small, stamp_of, strict_json

log = logging.getLogger(__name__)

METADATA_KEY = "neopp_sampling"  # safetensors metadata: a JSON object of recommended sampling values
MAX_SIDECAR_BYTES = 64 << 10
SIDECAR_DEPTH = 3  # {"sampling": {"cfg_interval": [...]}}
# Sampling values an adapter may recommend (an 8-step adapter: 8 steps, guidance off).
RECOMMENDABLE = ("infer_steps", "cfg_scale", "timestep_shift", "cfg_interval", "enable_cfg")
DEFAULT_MAX_BYTES = 1 << 30
REMEMBERED = 4096  # refusals and judged headers kept, by adapter name


def check_name(name: str) -> str:
    """An adapter name (``neopp.contract.adapter_names``: the rule the door and the listings share)."""
    if not is_name(name):
        raise InputError(f"LORA: {shown(name)} is not an adapter name (letters, digits, '.', '_', '-'; "
                         f"at most {MAX_NAME_CHARS}, starting with a letter or digit)")
    return name


def lora_inputs(name: str | None, scale: Any) -> tuple[str, float]:
    """A request's ``LORA`` (a name, never a path) and ``LORA_SCALE`` (default 1.0)."""
    if name is None:
        raise InputError("LORA_SCALE: given without LORA (name the adapter it scales)")
    check_name(name)
    value = 1.0 if scale is None else float(getattr(scale, "reshape", lambda _: [scale])(-1)[0])
    if not math.isfinite(value) or abs(value) > SCALE_MAX_ABS:
        raise InputError(f"LORA_SCALE: must be a finite number within -{SCALE_MAX_ABS:g}..{SCALE_MAX_ABS:g}, "
                         f"got {shown(value)}")
    return name, value


def refused(name: str, exc: BaseException) -> InputError:
    """The request's error for adapter ``name``: its name and the rule, never a path (a system
    error says only its kind; an unexpected one is logged for the operator)."""
    if not isinstance(exc, (ConfigError, OSError)):
        log.error("adapter %r: unexpected %s while reading it", name, type(exc).__name__, exc_info=exc)
    reason = exc if isinstance(exc, ConfigError) else f"its file cannot be read ({type(exc).__name__})"
    return InputError(f"LORA: adapter {name!r} refused: {reason}")


@dataclass(frozen=True)
class Refusal:
    """A remembered refusal's message."""

    text: str


class Remembered:
    """What was decided about each adapter's file (a value or a refusal), by file stamp: a bad
    file is judged once, not once per request; a file replaced in place is judged again."""

    def __init__(self, size: int = REMEMBERED) -> None:
        self._items: OrderedDict[str, tuple[Any, Any]] = OrderedDict()
        self._size, self._lock = size, threading.Lock()

    def get(self, name: str, stamp: Any) -> Any:
        """The value remembered for ``name`` at ``stamp`` (a refusal is raised); None when none."""
        with self._lock:
            held = self._items.get(name)
        if held is None or held[0] != stamp:
            return None
        if isinstance(held[1], Refusal):
            raise InputError(held[1].text)  # a new one each time: a raised error collects its traceback
        return held[1]

    def put(self, name: str, stamp: Any, value: Any) -> Any:
        with self._lock:
            self._items.pop(name, None)
            self._items[name] = (stamp, value)
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return value

    def refuse(self, name: str, stamp: Any, exc: BaseException, now: Callable[[], Any]) -> InputError:
        """The refusal of ``name``, remembered only while the file is still the one judged
        (``now()``, its stamp again, equals ``stamp``): a file caught mid-rewrite is judged again."""
        error = refused(name, exc)
        try:
            unchanged = not isinstance(exc, FileChanged) and now() == stamp
        except OSError:
            unchanged = False
        if unchanged:
            self.put(name, stamp, Refusal(str(error)))
        return error


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
        self._judged = Remembered()

    def listing(self, limit: int = LISTED) -> Listing:
        """The adapters on offer: the first ``limit`` names, sorted, and the count."""
        return list_adapters(self.folder, limit)

    def names(self) -> list[str]:
        """The first names on offer, sorted (``listing`` tells the count)."""
        return list(self.listing().names)

    def path(self, name: str) -> Path:
        """The file of adapter ``name``; InputError naming LORA when there is none."""
        check_name(name)
        path = adapter_file(self.folder, name)
        if path is None:
            offered = self.listing(REFUSAL_LISTED).text() if self.folder is not None else "none (no adapter directory)"
            raise InputError(f"LORA: no adapter named {shown(name)} on this model; offered: {offered}")
        return path

    def recommended(self, name: str) -> dict[str, Any]:
        """Sampling values the adapter recommends: its sidecar ``<name>.json`` (key ``sampling``, or
        the object itself), else its safetensors metadata ``neopp_sampling``; {} when neither.
        The file's header is judged on the way (``lora.judge_lora_file``), once per file stamp:
        InputError naming LORA and the rule."""
        path = self.path(name)
        sidecar = adapter_file(self.folder, name, ".json")

        def now() -> tuple[Any, Any]:
            return stamp_of(path.stat()), None if sidecar is None else stamp_of(sidecar.stat())

        try:
            stamp = now()
        except OSError as exc:
            raise refused(name, exc) from None
        known = self._judged.get(name, stamp)
        if known is not None:
            return known
        try:
            return self._judged.put(name, stamp, self._recommended(path, sidecar))
        except Exception as exc:  # noqa: BLE001 - whatever a file does to the reader refuses it, by name
            raise self._judged.refuse(name, stamp, exc, now) from None

    @staticmethod
    def _recommended(path: Path, sidecar: Path | None) -> dict[str, Any]:
        from .lora import judge_lora_file  # torch: only where an adapter is judged

        metadata = judge_lora_file(path).metadata
        if sidecar is not None:
            raw = strict_json(read_small(sidecar, MAX_SIDECAR_BYTES, "its sidecar"), SIDECAR_DEPTH, "its sidecar")
            raw = raw.get("sampling", raw) if isinstance(raw, dict) else raw
            return recommended_values(raw, "its sidecar")
        text = metadata.get(METADATA_KEY)
        if text is None:
            return {}
        where = f"its metadata key '{METADATA_KEY}'"
        return recommended_values(strict_json(text.encode(), SIDECAR_DEPTH, where), where)


def adapter_sampling(directory: AdapterDirectory, name: str, defaults: SamplingParams,
                     overrides: Mapping[str, Any]) -> SamplingParams:
    """A request's sampling values under adapter ``name`` (``apply_recommended``); a sidecar or
    metadata that cannot be read refuses the request, naming LORA and the key."""
    return apply_recommended(defaults, overrides, directory.recommended(name))


def apply_recommended(defaults: SamplingParams, overrides: Mapping[str, Any],
                      recommended: Mapping[str, Any]) -> SamplingParams:
    """The request's sampling values: its own overrides, then the adapter's recommendations for
    what it left unset, then the model's defaults. Guidance off (``enable_cfg``) is recommended
    only to a request that sets no guidance value of its own."""
    guided = any(k in overrides for k in ("cfg_scale", "cfg_interval"))
    taken = {k: v for k, v in recommended.items() if k not in overrides and not (k == "enable_cfg" and guided)}
    return defaults.replace(**taken, **overrides)


class AdapterStore:
    """Adapters resident in one model's process: loaded on first use, least recently used evicted
    while their bytes exceed ``max_bytes`` (an adapter bigger than the bound alone is refused
    from its header and file size, before its factors are read).

    ``load`` is given the adapter's name, file, recommended values and ``max_bytes`` and returns
    the adapter fitted to the tower, stamped with the file it read; a request that holds an
    adapter keeps it alive even once evicted. A refusal is remembered by file stamp.
    """

    def __init__(self, directory: AdapterDirectory, load: Any, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes <= 0:
            raise ConfigError(f"parameter lora_max_bytes: must be positive, got {max_bytes}")
        self.directory, self._load, self.max_bytes = directory, load, max_bytes
        self._resident: OrderedDict[str, Any] = OrderedDict()
        self._stamps: dict[str, Any] = {}  # each resident adapter's file stamp when it was read
        self._refused = Remembered()
        self._lock = threading.Lock()
        self._loading = threading.Lock()  # one load at a time: two requests for one adapter read it once

    def get(self, name: str) -> Any:
        """The adapter ``name``, loaded if it is not resident or its file changed since (a file
        replaced in place is read again; a removed one is refused and dropped); InputError naming LORA."""
        try:
            path = self.directory.path(name)
            stamp = stamp_of(path.stat())
        except (InputError, OSError) as exc:
            self.unload(name)
            raise exc if isinstance(exc, InputError) else refused(name, exc) from None
        held = self._held(name, stamp)
        if held is not None:
            return held
        try:
            check_size(stamp[2], self.max_bytes)  # its size alone: nothing of it is read
        except ConfigError as exc:
            raise refused(name, exc) from None
        with self._loading:
            return self._held(name, stamp) or self._read(name, path, stamp)

    def _held(self, name: str, stamp: Any) -> Any:
        """The resident adapter of this file stamp, or None; a remembered refusal is raised."""
        with self._lock:
            if name in self._resident and self._stamps.get(name) == stamp:
                self._resident.move_to_end(name)
                return self._resident[name]
        return self._refused.get(name, stamp)

    def _read(self, name: str, path: Path, stamp: Any) -> Any:
        recommended = self.directory.recommended(name)

        def now() -> Any:
            return stamp_of(path.stat())

        try:
            adapter = self._load(name, path, recommended, self.max_bytes)
        except Exception as exc:  # noqa: BLE001 - whatever a file does to the reader refuses it, by name
            raise self._refused.refuse(name, stamp, exc, now) from None
        if adapter.nbytes > self.max_bytes:
            raise self._refused.refuse(name, stamp, ConfigError(
                f"takes {adapter.nbytes} bytes, over this model's adapter memory bound of {self.max_bytes} "
                "(parameter lora_max_bytes)"), now)
        with self._lock:
            self._resident.pop(name, None)
            self._resident[name], self._stamps[name] = adapter, adapter.stamp or stamp
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
