"""Triton's health answers, polled in the background, so that a health check costs the door no
round trip to Triton and answers within its own loop even while that loop is busy with attackers'
bytes: a probe of the door waits for no one else's request. Each answer is at most ``period_s``
old; one older than ``fresh_s`` (the poll itself stuck) is not used, nor is a refusal (it may be
from just before the server became ready): then the check goes to Triton as any control route does.
"""

from __future__ import annotations

import asyncio
import time

from . import strict_json
from .door_error import DoorError
from .upstream import ControlResponse, Upstream

PATHS = ("/v2/health/live", "/v2/health/ready")


class HealthCache:
    """The last answer of each health path and when it came."""

    def __init__(self, upstream: Upstream, period_s: float = 0.5, fresh_s: float = 2.0) -> None:
        self.upstream, self.period_s, self.fresh_s = upstream, period_s, fresh_s
        self.answers: dict[str, tuple[ControlResponse, float]] = {}

    def get(self, path: str) -> ControlResponse | None:
        answer, at = self.answers.get(path, (None, 0.0))
        return answer if answer is not None and time.monotonic() - at <= self.fresh_s else None

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            for path in PATHS:
                try:
                    answer = await asyncio.wait_for(self.upstream.control("GET", path, None, None), self.fresh_s)
                except DoorError as exc:
                    answer = ControlResponse(exc.status, strict_json.dumps({"error": exc.message}), "application/json")
                except asyncio.TimeoutError:
                    continue  # no answer in time: the cached one ages out, checks go to Triton
                self.answers[path] = (answer, time.monotonic())
            await asyncio.sleep(self.period_s)
