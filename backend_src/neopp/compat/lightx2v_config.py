"""LightX2V's runner config: a dict that can be locked, and the mode it describes.

LightX2V locks the runner's config after start-up and changes it only through
``modify_config`` (inside ``temporarily_unlocked``); LightLLM and LightX2V's own tests rely
on that, so a write to a locked config is an error here too, not a silent change.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..json_file import read_json_object
from ..modes import ModeSpec, mode_from_dict

# Keys of the config that only LightX2V's debug paths read; accepted so LightLLM's calls work.
DEBUG_KEYS = ("save_result_for_debug", "load_kv_cache_in_pipeline_for_debug")


class LockedConfig(dict):
    """A dict that refuses writes while locked."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._locked = False

    @property
    def locked(self) -> bool:
        return self._locked

    def lock(self) -> None:
        self._locked = True

    @contextmanager
    def temporarily_unlocked(self) -> Iterator[LockedConfig]:
        """Writable inside the block; locked again after it if it was locked before."""
        was = self._locked
        self._locked = False
        try:
            yield self
        finally:
            self._locked = was

    def _check(self, key: Any) -> None:
        if self._locked:
            raise ConfigError(f"config is locked: {key!r} can change only through modify_config "
                              "(or inside config.temporarily_unlocked())")

    def __setitem__(self, key: Any, value: Any) -> None:
        self._check(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self._check(key)
        super().__delitem__(key)

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        changes = dict(*args, **kwargs)
        if changes:
            self._check(next(iter(changes)))
        super().update(changes)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self._check(key)
        return super().setdefault(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        self._check(key)
        return super().pop(key, *default)

    def clear(self) -> None:
        self._check("*")
        super().clear()


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A LightX2V/NeoPP mode JSON (the layout of this project's ``configs/neopp/*.json``)."""
    return read_json_object(path, "config_json")


def mode_of(config: Mapping[str, Any], name: str, base_dir: Path | None, lora_dir: Path | None) -> ModeSpec:
    """The mode the merged config describes; ``size`` / ``target_height``+``target_width`` set its default size."""
    raw = dict(config)
    if "target_shape" not in raw and "default_size" not in raw:
        if raw.get("size"):
            raw["default_size"] = list(raw["size"])
        elif raw.get("target_height") and raw.get("target_width"):
            raw["default_size"] = [raw["target_height"], raw["target_width"]]
    return mode_from_dict(raw, name=name, base_dir=base_dir, lora_dir=lora_dir)
