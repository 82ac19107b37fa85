"""The door's and the supervisor's own figures, in Prometheus text on the door's ``/metrics``.

Triton's metrics port carries the models' series; these are the ones only the launcher's process
knows: requests the door answered itself and why, request bodies held, server restarts and why.
"""

from __future__ import annotations

import threading
from collections import Counter


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}" if pairs else ""


class DoorMetrics:
    """Counters and gauges, safe to bump from the door's loop and the supervisor's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[tuple[str, str], ...]] = Counter()
        self.refused: Counter[tuple[tuple[str, str], ...]] = Counter()
        self.restarts: Counter[tuple[tuple[str, str], ...]] = Counter()
        self.cancelled = 0
        self.connections = 0  # open now (set by the door's connection table)

    def request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(("route", route), ("code", str(status)))] += 1

    def refusal(self, reason: str) -> None:
        with self._lock:
            self.refused[(("reason", reason),)] += 1

    def cancel(self) -> None:
        with self._lock:
            self.cancelled += 1

    def restart(self, reason: str) -> None:
        with self._lock:
            self.restarts[(("reason", reason),)] += 1

    def restart_count(self) -> int:
        with self._lock:
            return sum(self.restarts.values())

    def render(self, body_bytes_held: int) -> str:
        """The text exposition; ``body_bytes_held`` is read from the door's budget at the time."""
        with self._lock:
            lines = []
            for name, help_text, series in (
                    ("neopp_http_requests_total", "HTTP requests the door answered, by route and status code",
                     self.requests),
                    ("neopp_http_refused_total", "HTTP requests the door refused itself, by reason", self.refused),
                    ("neopp_server_restarts_total", "tritonserver restarts by the launcher, by reason",
                     self.restarts)):
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
                lines += [f"{name}{_labels(k)} {v}" for k, v in sorted(series.items())]
            lines += ["# HELP neopp_http_body_bytes_held bytes of request bodies the door holds now",
                      "# TYPE neopp_http_body_bytes_held gauge", f"neopp_http_body_bytes_held {body_bytes_held}",
                      "# HELP neopp_http_cancelled_total requests cancelled because the HTTP client left",
                      "# TYPE neopp_http_cancelled_total counter", f"neopp_http_cancelled_total {self.cancelled}",
                      "# HELP neopp_http_connections HTTP connections open now",
                      "# TYPE neopp_http_connections gauge", f"neopp_http_connections {self.connections}"]
            return "\n".join(lines) + "\n"
