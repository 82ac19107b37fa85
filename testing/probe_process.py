"""A health probe in a process of its own: what a load balancer's checker sees of the door.

A probe thread inside a load generator measures the generator too: its answer waits for that
process's interpreter, which a hundred client threads hold most of the time (on a busy 2-core
machine the same door measured 62 ms p99 from inside a 6-thread generator and 38 ms from here).
The child probes until its standard input closes, then prints what it saw as one JSON line.

    python -m testing.probe_process --port 8000 [--interval-s 0.25] [--path /v2/health/live]

``FloorServer`` is the yardstick beside it: a one-thread HTTP server in a process of its own that
answers every GET with an empty 200. Probed the same way at the same time, it shows what any
server's health answer costs on this machine at that moment (scheduling, the probe's own turn).

    python -m testing.probe_process --serve-floor PORT
"""

from __future__ import annotations

import argparse
import http.server
import json
import select
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence

from neopp.ports import LOOPBACK, free_ports
from testing.door_attacks import request


class ProcessProbe:
    """``GET path`` every ``interval_s`` on a fresh connection, from a child process, until stopped."""

    def __init__(self, port: int, interval_s: float = 0.25, path: str = "/v2/health/live") -> None:
        self.command = [sys.executable, "-m", "testing.probe_process", "--port", str(port),
                        "--interval-s", str(interval_s), "--path", path]
        self.latencies: list[float] = []
        self.statuses: Counter[str] = Counter()
        self._proc: subprocess.Popen | None = None

    def start(self) -> ProcessProbe:
        self._proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return self

    def stop(self) -> ProcessProbe:
        """Close the child's input; it finishes its probe and reports."""
        assert self._proc is not None
        try:
            out, _ = self._proc.communicate(input=b"", timeout=60)  # closes its input
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        if out.strip():
            doc = json.loads(out.splitlines()[-1])
            self.latencies = doc["latencies"]
            self.statuses = Counter(doc["statuses"])
        return self


class FloorServer:
    """The one-thread server of this module, started as a child, stopped by its process id."""

    def __init__(self) -> None:
        self.port = free_ports(1)[0]
        self._proc = subprocess.Popen([sys.executable, "-m", "testing.probe_process", "--serve-floor", str(self.port)],
                                      stdout=subprocess.PIPE)
        assert self._proc.stdout is not None
        self._proc.stdout.readline()  # "listening": the port is bound before the first probe

    def stop(self) -> None:
        self._proc.kill()
        self._proc.wait(timeout=30)


class _Empty(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def serve_floor(port: int) -> None:
    server = http.server.HTTPServer((LOOPBACK, port), _Empty)
    print("listening", flush=True)
    server.serve_forever()


def probe(port: int, interval_s: float, path: str) -> dict:
    latencies, statuses = [], Counter()
    head = f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode()
    while True:
        began = time.monotonic()
        try:
            status: object = request(port, head, timeout=30)[0]
        except OSError as exc:
            status = type(exc).__name__
        latencies.append(time.monotonic() - began)
        statuses[str(status)] += 1
        wait = max(0.0, interval_s - (time.monotonic() - began))
        if select.select([sys.stdin], [], [], wait)[0]:  # our input closed: the parent is done
            return {"latencies": latencies, "statuses": dict(statuses)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testing.probe_process", description=__doc__)
    parser.add_argument("--port", type=int)
    parser.add_argument("--interval-s", type=float, default=0.25)
    parser.add_argument("--path", default="/v2/health/live")
    parser.add_argument("--serve-floor", type=int, metavar="PORT", help="be the floor server on PORT instead")
    ns = parser.parse_args(argv)
    if ns.serve_floor:
        serve_floor(ns.serve_floor)
    if ns.port is None:
        parser.error("--port is required")
    print(json.dumps(probe(ns.port, ns.interval_s, ns.path)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
