"""A drill's way to stop an engine's loop on a live server, as an unforeseen bug would.

With ``NEOPP_ENGINE_FAULT_FILE`` set in the server's environment (never in production), the loop
of every step-batching engine raises at its next pass while that file exists: the drill of a
dead loop (the model turns unready, what the loop held ends with UNAVAILABLE, the model is
replaced). A file that holds the word ``hold`` instead pauses the loop before its next pass
(for at most HOLD_S), so a drill can queue requests and then watch the order they run in.
Unset, the check is one attribute read.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

FAULT_ENV = "NEOPP_ENGINE_FAULT_FILE"
HOLD = "hold"
HOLD_S = 60.0


class InjectedFault(RuntimeError):
    """Raised by a drill's fault point: not an error any request can cause."""


class FaultPoint:
    """The fault file named at start, if any."""

    def __init__(self) -> None:
        named = os.environ.get(FAULT_ENV, "")
        self.path = Path(named) if named else None

    def check(self) -> None:
        if self.path is None or not self.path.exists():
            return
        if self._says_hold():
            deadline = time.monotonic() + HOLD_S
            while self._says_hold() and time.monotonic() < deadline:
                time.sleep(0.02)
            return
        raise InjectedFault(f"fault drill: {FAULT_ENV} is set and its file exists")

    def _says_hold(self) -> bool:
        try:
            return self.path is not None and self.path.read_text(errors="replace").strip() == HOLD
        except OSError:
            return False
