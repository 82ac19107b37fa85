"""Connections that cannot starve others: timed out when idle, capped per client address, the
idle ones given up first.

uvicorn's own bounds count every open connection (``limit_concurrency``: past it, every request,
health checks included, is a 503) and time out only the pause after a response, reset by any
byte. Here instead:

* a connection must complete a request head within ``idle_timeout_s`` of opening, and again of
  its last response (keep-alive); bytes that never make a head do not extend it;
* at ``max_client_connections`` of one address, or ``max_connections`` in all, a new connection
  takes the place of one idle for EVICT_AFTER_S or more (one that never sent a request first, the
  oldest first; a connection younger than that may be about to send its head); only when none is
  is it answered 503 and closed;
* a request head is at most HEADER_LIMIT bytes whether it arrives in one read or many (431), and
  a malformed one is a JSON 400 that prints nothing.
"""

from __future__ import annotations

import asyncio
import http
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from . import strict_json
from .bounds import HEADER_LIMIT, DoorLimits
from .door_metrics import DoorMetrics
from .responses import json_response

EVICT_AFTER_S = 1.0
CLIENT_NOISE = ("Invalid HTTP request received.", "Unsupported upgrade request.")  # uvicorn's per-request lines


class _Quiet(logging.Filter):
    """A client's malformed request is counted in the door's metrics, not a line in the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in CLIENT_NOISE and not record.getMessage().startswith("No supported WebSocket")


logging.getLogger("uvicorn.error").addFilter(_Quiet())


def raw_answer(transport: asyncio.Transport, status: int, message: str, headers: str = "") -> None:
    """An answer written straight to the socket (no request was parsed to answer through), then close."""
    body = strict_json.dumps({"error": message})
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n{headers}\r\n")
    transport.write(head.encode() + body)
    transport.close()


class ConnectionTable:
    """Open connections by client address, and which one gives way when a cap is reached."""

    def __init__(self, limits: DoorLimits, metrics: DoorMetrics) -> None:
        self.limits, self.metrics = limits, metrics
        self.by_client: dict[str, list[DoorProtocol]] = {}
        self.count = 0

    def admit(self, conn: DoorProtocol) -> bool:
        """Room for ``conn``, made by closing an idle connection if need be; False: none is idle."""
        mine = self.by_client.setdefault(conn.address, [])
        if len(mine) >= self.limits.max_client_connections and not self._evict(mine):
            return False
        if self.count >= self.limits.max_connections and not self._evict(
                [c for conns in self.by_client.values() for c in conns]):
            return False
        mine.append(conn)
        self.count += 1
        self.metrics.connections = self.count
        return True

    def _evict(self, candidates: list[DoorProtocol]) -> bool:
        settled = time.monotonic() - EVICT_AFTER_S
        idle = [c for c in candidates if c.idle and c.idle_since <= settled]
        if not idle:
            return False
        victim = min(idle, key=lambda c: (c.served > 0, c.idle_since))  # never used first, then the longest idle
        self.remove(victim)
        self.metrics.refusal("evicted_idle")
        victim.transport.close()
        return True

    def remove(self, conn: DoorProtocol) -> None:
        mine = self.by_client.get(conn.address, [])
        if conn in mine:
            mine.remove(conn)
            self.count -= 1
            self.metrics.connections = self.count
            if not mine:
                del self.by_client[conn.address]


class DoorProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 connection with the door's timeouts, caps and head limit."""

    def __init__(self, *args: Any, table: ConnectionTable, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.table, self.limits, self.metrics = table, table.limits, table.metrics
        self.idle_since, self.served, self.address = time.monotonic(), 0, ""
        self._timer: asyncio.TimerHandle | None = None

    @property
    def idle(self) -> bool:
        """No request of this connection is being read or answered."""
        return self.cycle is None or self.cycle.response_complete

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.address = self.client[0] if self.client else ""
        if not self.table.admit(self):
            self.metrics.refusal("connections")
            raw_answer(transport, 503, f"too many open connections ({self.limits.max_client_connections} per client, "
                       f"{self.limits.max_connections} in all) and none idle; retry shortly", "retry-after: 1\r\n")
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.table.remove(self)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request head arrived: the request has its own bounds now
            self._disarm()

    def on_response_complete(self) -> None:
        self.served, self.idle_since = self.served + 1, time.monotonic()
        self._arm()  # before uvicorn looks at pipelined requests, which disarm it again
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        """h11 refused the head: too long (it arrived in pieces past the limit) or malformed."""
        self._disarm()
        if len(self.conn.trailing_data[0]) > HEADER_LIMIT:
            self.metrics.refusal("head_too_large")
            raw_answer(self.transport, 431, f"the request line and headers are over the {HEADER_LIMIT} byte limit")
        else:
            self.metrics.refusal("malformed_http")
            raw_answer(self.transport, 400, "malformed HTTP/1.1 request")

    def _arm(self) -> None:
        self._disarm()
        self._timer = self.loop.call_later(self.limits.idle_timeout_s, self._idle_timeout)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _idle_timeout(self) -> None:
        self._timer = None
        if self.transport.is_closing() or not self.idle:
            return
        self.metrics.refusal("idle_timeout")
        if self.conn.trailing_data[0]:  # part of a head: say why it is dropped
            raw_answer(self.transport, 408, f"no complete request head within {self.limits.idle_timeout_s:.0f}s")
        else:
            self.transport.close()


class HeadLimit:
    """The head limit for heads that arrived whole (h11 bounds only what it still waits for)."""

    def __init__(self, app: ASGIApp, metrics: DoorMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = (len(scope["method"]) + len(scope["raw_path"]) + len(scope["query_string"]) + 12
                    + sum(len(name) + len(value) + 4 for name, value in scope["headers"]))
            if size > HEADER_LIMIT:
                self.metrics.refusal("head_too_large")
                answer = json_response(431, {"error": f"the request line and headers are {size} bytes, over the "
                                             f"{HEADER_LIMIT} byte limit"}, {"Connection": "close"})
                await answer(scope, receive, send)
                return
        await self.app(scope, receive, send)
