"""A health probe in a process of its own: what a load balancer's checker sees of the door.

A probe thread inside a load generator measures the generator too: its answer waits for that
process's interpreter, which a hundred client threads hold most of the time (on a busy 2-core
machine the same door measured 62 ms p99 from inside a 6-thread generator and 38 ms from here).
The child probes until its standard input closes, then prints what it saw as one JSON line.

    python -m testing.probe_process --port 8000 [--interval-s 0.25] [--path /v2/health/live]
"""

from __future__ import annotations

import argparse
import json
import select
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence

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
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--interval-s", type=float, default=0.25)
    parser.add_argument("--path", default="/v2/health/live")
    ns = parser.parse_args(argv)
    print(json.dumps(probe(ns.port, ns.interval_s, ns.path)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
