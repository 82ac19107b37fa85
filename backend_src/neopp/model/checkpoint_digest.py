"""A checkpoint's content hash, as a picture's record names it.

The SHA-256 of the files that decide the pixels (``config.json`` and every weight file: the
``*.safetensors`` of a folder, or the ``.gguf`` file named), each hashed whole and combined by
name, so two folders holding the same files hash alike wherever they are. Hashing a real
checkpoint reads tens of GB once; each file's hash is kept in a small cache keyed by the file's
path, size and modification time (``$XDG_CACHE_HOME/neopp``, else ``~/.cache/neopp``), and a
lock lets one process hash while the other models loading the same files wait for its answer.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from pathlib import Path

from .checkpoint_config import checkpoint_folder, is_gguf

CACHE_NAME = "file-sha256.json"
CHUNK = 8 << 20


def weight_files(ckpt: str | Path) -> list[Path]:
    """The files whose bytes decide a checkpoint's pictures, in a stable order."""
    ckpt = Path(ckpt)
    folder = checkpoint_folder(ckpt)
    weights = [ckpt] if is_gguf(ckpt) else sorted(folder.glob("*.safetensors"))
    config = folder / "config.json"
    return ([config] if config.is_file() else []) + weights


def checkpoint_digest(ckpt: str | Path, cache_dir: Path | None = None) -> str:
    """The checkpoint's content hash (hex)."""
    combined = hashlib.sha256()
    files = weight_files(ckpt)
    hashes = _file_hashes(files, cache_dir or _cache_dir())
    for file in files:
        combined.update(f"{file.name}\0{hashes[file]}\n".encode())
    return combined.hexdigest()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "neopp"


def _file_hashes(files: list[Path], cache_dir: Path) -> dict[Path, str]:
    """Each file's SHA-256, from the cache where its path, size and time still match; each new
    hash is kept at once, so a load stopped half way keeps what it hashed."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock = open(cache_dir / (CACHE_NAME + ".lock"), "a")  # noqa: SIM115 - held across the hashing
    except OSError:  # no cache here (a read-only home): hash every time
        return {file: _sha256(file) for file in files}
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:  # a filesystem without locks: hash without waiting for the others
            pass
        out = {}
        for file in files:
            cache = _read_cache(cache_dir / CACHE_NAME)
            stat = file.stat()
            key, stamp = str(file.resolve()), [stat.st_size, stat.st_mtime_ns]
            kept = cache.get(key)
            if isinstance(kept, list) and len(kept) == 3 and kept[:2] == stamp and isinstance(kept[2], str):
                out[file] = kept[2]
                continue
            out[file] = _sha256(file)
            cache[key] = [*stamp, out[file]]
            _write_cache(cache_dir / CACHE_NAME, cache)
    return out


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _read_cache(path: Path) -> dict[str, object]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _write_cache(path: Path, cache: dict[str, object]) -> None:
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
            json.dump(cache, tmp)
        os.replace(tmp.name, path)
    except OSError:
        pass  # the hash stands; only the next load pays for it again
