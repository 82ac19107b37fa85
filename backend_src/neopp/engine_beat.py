"""An engine's heartbeat: the fact, published by the stub that runs a mode's engine, that its loop
can serve; read by the launcher to take a model out of service and replace it.

The engine's stub rewrites ``<owner>.beat`` next to its socket every ``BEAT_S`` seconds: alive,
or dead with the reason (its loop stopped, its thread is gone). A stub whose engine is dead stays
up and answers every request at once with UNAVAILABLE, so the launcher can mark the model not
ready within a poll and reload it while clients are told to retry, never left waiting. The
folder is this user's and this tritonserver's (0700), so two servers never read each other's.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BEAT_S = 0.2
MAX_BEAT_BYTES = 4096  # a beat is a few dozen bytes; anything larger is not one


def engines_folder(server_pid: int) -> Path:
    """Where the engines of the tritonserver ``server_pid`` listen and beat."""
    return Path(tempfile.gettempdir()) / f"neopp-engines-{os.getuid()}-{server_pid}"


def beat_path(owner_model: str, server_pid: int) -> Path:
    return engines_folder(server_pid) / f"{owner_model}.beat"


@dataclass(frozen=True)
class Beat:
    """One reading: whether the engine can serve, why not, and when it was written (monotonic)."""

    alive: bool
    why: str
    at: float


def write_beat(path: Path, failure: str | None) -> None:
    """Replace the beat at once (a reader never sees half of one)."""
    text = json.dumps({"alive": failure is None, "why": (failure or "")[:512], "at": time.monotonic()})
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_beat(path: Path) -> Beat | None:
    """The last beat, or None when there is none (no engine stub, or not one of ours)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(MAX_BEAT_BYTES + 1)[:MAX_BEAT_BYTES])
        return Beat(data["alive"] is True, str(data["why"])[:512], float(data["at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
