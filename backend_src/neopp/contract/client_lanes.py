"""Client lanes: the name under which a request waits its turn in a model's step scheduler.

The scheduler takes turns between lanes (round-robin), so one client's burst cannot make another
client's request wait behind all of it. The HTTP door names each request's lane itself, from the
client it sees, and overwrites whatever the client sent; a gRPC client, which reaches Triton
directly (LightLLM's deployment, a trusted backend behind the API key), may name its own lane
with the request parameter below, and shares one lane with every other gRPC client if it does
not. Standard library only: the door's process and the models' stubs both read this rule.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

PARAMETER = "neopp_client"  # the request parameter that carries the lane
# Triton's queue in front of a plain generation model serves the lower priority number first (its
# config's priority_levels); the door gives a client's k-th generation in flight priority min(k, 4),
# so a client's first request passes every other client's backlog there too. Requests that set none
# (a gRPC client, a BLS model's calls) wait at the default level, 2.
PRIORITY_LEVELS = 4
MAX_CHARS = 64
RULE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.:-]{{0,{MAX_CHARS - 1}}}")
UNNAMED = ""  # the lane of requests that name none


class LaneError(ValueError):
    """A lane parameter that breaks the rule (the request is refused, naming the parameter)."""


def lane_of(parameters: Mapping[str, Any] | None) -> str:
    """The lane a request's parameters name (UNNAMED when they name none)."""
    if not parameters or PARAMETER not in parameters:
        return UNNAMED
    value = parameters[PARAMETER]
    if not isinstance(value, str) or RULE.fullmatch(value) is None:
        raise LaneError(f"parameter {PARAMETER}: a client lane is 1 to {MAX_CHARS} letters, digits or '_.:-', "
                        "starting with a letter or digit")
    return value

