"""A request's client lane, read where a model receives it (the rule is ``neopp.contract.client_lanes``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..contract.client_lanes import PARAMETER, LaneError, lane_of
from ..errors import InputError


def request_parameters(text: Any) -> dict[str, Any]:
    """A request's parameters from Triton's JSON of them ({} when it has none)."""
    params = json.loads(text) if isinstance(text, str) and text else {}
    return params if isinstance(params, dict) else {}


def request_lane(parameters: Mapping[str, Any] | None) -> str:
    """The lane a request's parameters name; a bad one is the request's fault, named."""
    try:
        return lane_of(parameters)
    except LaneError as exc:
        raise InputError(str(exc)) from None


def forwarded_lane(request: Any) -> dict[str, str]:
    """The parameters a BLS model's generation request carries for its client's ``request``: its
    lane, which follows the request."""
    lane = request_lane(request_parameters(request.parameters()))
    return {PARAMETER: lane} if lane else {}
