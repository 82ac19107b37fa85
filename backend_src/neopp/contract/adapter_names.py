"""Adapter names and the adapters a folder offers: one rule for the model, its inputs and the door.

A request names an adapter, never a path; the name is a file's stem in the model's adapter
folder. The door lists the same folder in ``/v1/models`` and the model refuses an unknown name
with the same listing, so both read it here (standard library only: the launcher's process
imports this and nothing else of the generator). What is on offer is a regular file, or a link
that stays inside the folder and ends on one: a link to a device, a FIFO or a file elsewhere
offers nothing. Listings are bounded: a folder of many thousands of adapters is named by its
first names and its count.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

# One length for the name rule, the LORA input's cap (neopp.limits.MAX_TEXT_BYTES; a name is ASCII)
# and the door's body field.
MAX_NAME_CHARS = 64
NAME_RULE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_NAME_CHARS - 1}}}")
SUFFIX = ".safetensors"
LISTED = 100  # names a listing carries; past it, the count says how many more there are
REFUSAL_LISTED = 10  # names an unknown name's refusal quotes
SCALE_MAX_ABS = 8.0  # LORA_SCALE / lora_scale: an adapter is trained at 1; far beyond, the image is noise


def is_name(name: object) -> bool:
    """Letters, digits, ``.``, ``_``, ``-``; at most MAX_NAME_CHARS; starts with a letter or digit; no ``..``."""
    return isinstance(name, str) and NAME_RULE.fullmatch(name) is not None and ".." not in name


@dataclass(frozen=True)
class Listing:
    """The first ``len(names)`` adapter names of a folder, sorted, and how many it offers in all."""

    names: tuple[str, ...]
    total: int

    def text(self) -> str:
        """The listing as an error message quotes it: the names, then ``and K more``."""
        if not self.total:
            return "none"
        more = self.total - len(self.names)
        return ", ".join(self.names) + (f" and {more} more" if more else "")


def _offered(folder: Path, entry: os.DirEntry) -> bool:
    """A regular file, or a link inside ``folder`` that ends on a regular file (no device, FIFO
    or file elsewhere)."""
    try:
        if entry.is_file(follow_symlinks=False):
            return True
        if not entry.is_symlink():
            return False
        target = Path(entry.path).resolve(strict=True)
        return target.parent == folder and stat.S_ISREG(target.stat().st_mode)
    except (OSError, RuntimeError):  # a dangling or looping link offers nothing
        return False


def list_adapters(folder: str | Path | None, limit: int = LISTED) -> Listing:
    """The adapters ``folder`` offers: at most ``limit`` names, sorted, with the total count."""
    if folder is None:
        return Listing((), 0)
    try:
        root = Path(folder).resolve(strict=True)
        with os.scandir(root) as entries:
            found = [e.name[: -len(SUFFIX)] for e in entries
                     if e.name.endswith(SUFFIX) and is_name(e.name[: -len(SUFFIX)]) and _offered(root, e)]
    except (OSError, RuntimeError):
        return Listing((), 0)
    found.sort()
    return Listing(tuple(found[:limit]), len(found))


def adapter_file(folder: str | Path | None, name: str, suffix: str = SUFFIX) -> Path | None:
    """The file adapter ``name`` is read from (a link resolved), when ``folder`` offers it; else
    None. ``suffix`` ``.json``: its sidecar, on the same terms."""
    if folder is None or not is_name(name):
        return None
    try:
        root = Path(folder).resolve(strict=True)
        path = root / (name + suffix)
        info = path.lstat()
        if stat.S_ISREG(info.st_mode):
            return path
        if stat.S_ISLNK(info.st_mode):
            target = path.resolve(strict=True)
            if target.parent == root and stat.S_ISREG(target.stat().st_mode):
                return target
    except (OSError, RuntimeError):
        pass
    return None
