"""A request's client lane, read where a model receives it (the rule is ``neopp.client_lanes``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..client_lanes import LaneError, lane_of, passed_on
from ..errors import InputError


def request_lane(parameters: Mapping[str, Any] | None) -> str:
    """The lane a request's parameters name; a bad one is the request's fault, named."""
    try:
        return lane_of(parameters)
    except LaneError as exc:
        raise InputError(str(exc)) from None


def forwarded_lane(request: Any) -> dict[str, str]:
    """The parameters a BLS model's generation request carries for its client's ``request``: its lane."""
    try:
        return passed_on(request.parameters())
    except LaneError as exc:
        raise InputError(str(exc)) from None
