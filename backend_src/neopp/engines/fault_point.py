"""A drill's way to stop an engine's loop on a live server, as an unforeseen bug would.

With ``NEOPP_ENGINE_FAULT_FILE`` set in the server's environment (never in production), the loop
of every step-batching engine raises at its next pass while that file exists: the drill of a
dead loop (the model turns unready, what the loop held ends with UNAVAILABLE, the model is
replaced). Unset, the check is one attribute read.
"""

from __future__ import annotations

import os
from pathlib import Path

FAULT_ENV = "NEOPP_ENGINE_FAULT_FILE"


class InjectedFault(RuntimeError):
    """Raised by a drill's fault point: not an error any request can cause."""


class FaultPoint:
    """The fault file named at start, if any."""

    def __init__(self) -> None:
        named = os.environ.get(FAULT_ENV, "")
        self.path = Path(named) if named else None

    def check(self) -> None:
        if self.path is not None and self.path.exists():
            raise InjectedFault(f"fault drill: {FAULT_ENV} is set and its file exists")
