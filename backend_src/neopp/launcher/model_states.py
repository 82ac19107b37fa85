"""Which models a running server serves, and why the others are unavailable.

A model that fails to load (a bad checkpoint, a LoRA that does not fit) must not take the
others down, so the launcher starts tritonserver with :data:`KEEP_GOING_ARGS` and then reads
the repository index to tell the operator, model by model, what is READY and what is not
and why. The index belongs to the model-repository API, which needs the operator key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .inner_http import call

# Triton 2.51 ends the process when a --load-model fails unless told otherwise, and with strict
# readiness /v2/health/ready stays false while any requested model is unavailable.
KEEP_GOING_ARGS = ("--exit-on-error=false", "--strict-readiness=false")
NOT_REQUESTED = "not loaded (not named by --load-model)"


@dataclass(frozen=True)
class ModelState:
    """One row of the repository index."""

    name: str
    state: str
    reason: str = ""

    @property
    def ready(self) -> bool:
        return self.state == "READY"

    @property
    def why(self) -> str:
        """The first line of Triton's reason (the Python traceback after it is for the server log)."""
        if not self.state:
            return NOT_REQUESTED
        return self.reason.split("\n", 1)[0].strip()


def repository_index(http_target: str, headers: Mapping[str, str], timeout: float = 10.0) -> list[ModelState]:
    """``POST /v2/repository/index`` of the server at ``http_target`` (``host:port`` or ``unix:<path>``)."""
    status, body = call(http_target, "POST", "/v2/repository/index", {"Content-Type": "application/json", **headers},
                        b"{}", timeout=timeout)
    if status != 200:
        raise OSError(f"the repository index answered {status}: {body[:200].decode('utf-8', 'replace')}")
    return [ModelState(r["name"], r.get("state", ""), r.get("reason", "")) for r in json.loads(body)]


def state_table(states: Sequence[ModelState]) -> str:
    """One line per model: name, READY or UNAVAILABLE, and the reason when it is not ready."""
    width = max([len(s.name) for s in states] + [5])
    lines = [f"  {'model'.ljust(width)}  state"]
    for s in sorted(states, key=lambda s: s.name):
        lines.append(f"  {s.name.ljust(width)}  " + ("READY" if s.ready else f"{s.state or 'UNAVAILABLE'}  {s.why}"))
    return "\n".join(lines)
