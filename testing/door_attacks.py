"""What an attacker does to the HTTP door, and a health probe that times the door meanwhile.

    python -m testing.door_attacks --port 8000 [--seconds 30] [--model neopp_dense]

runs, against a running door on loopback, for ``--seconds``: 256 connections that never send a
request (opened again as the door drops them), three uploads that trickle a byte every 10 s into
a declared 128 MiB body, and three clients posting a 9 MB JSON object of 450k keys to
``generate`` and ``infer`` in turn, each kind from its own address (127.0.0.2, .3, .4: the door's
bounds per client are per address); and, all along, ``GET /v2/health/live`` every 50 ms on a fresh
connection from 127.0.0.1. It prints the probe's latencies (p50, p99, max) and statuses, and what
the attacks were answered. The e2e tests run the same pieces against the launcher they start.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from neopp.ports import LOOPBACK


@dataclass(frozen=True)
class SmallDoor:
    """The bounds the e2e tests run the launcher's door with: small, so that each is reached quickly."""

    key: str = "door-operator-key-0123456789abcdef"  # the admin key the tests' launcher is given
    budget_mib: int = 64  # --bodies-in-flight-mib
    client_mib: int = 48  # --client-bodies-mib
    read_timeout_s: float = 6.0  # --read-timeout-s
    min_rate_kib: int = 4096  # --min-upload-kib-s
    idle_s: float = 2.0  # --idle-timeout-s
    per_client: int = 32  # --max-client-connections
    connections: int = 96  # --max-connections
    inference: int = 12  # --max-inference

    def args(self) -> list[str]:
        return ["--bodies-in-flight-mib", str(self.budget_mib), "--client-bodies-mib", str(self.client_mib),
                "--read-timeout-s", str(self.read_timeout_s), "--min-upload-kib-s", str(self.min_rate_kib),
                "--idle-timeout-s", str(self.idle_s), "--max-client-connections", str(self.per_client),
                "--max-connections", str(self.connections), "--max-inference", str(self.inference),
                "--tensor-region-min-kib", "1"]  # the tiny KV goes through the region too


SMALL_DOOR = SmallDoor()
ATTACKERS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")  # loopback addresses other than a client's 127.0.0.1
BIG_OBJECT_KEYS = 450_000


def connect(port: int, source: str | None = None, timeout: float = 30.0) -> socket.socket:
    """A connection to the door from ``source`` (another loopback address: another client)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    if source:
        sock.bind((source, 0))
    sock.connect((LOOPBACK, port))
    return sock


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one answer; status 0 when the door closed without one."""
    data = b""
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except (ConnectionResetError, TimeoutError, OSError):
            chunk = b""
        if not chunk:
            break
        data += chunk
        head, blank, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"(?i)content-length: *(\d+)", head)
        if blank and length and len(body) >= int(length.group(1)):
            break
    if not data:
        return 0, {}, b""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if ": " in line)}
    return int(lines[0].split()[1]), headers, body


def request(port: int, raw: bytes, source: str | None = None, timeout: float = 60.0) -> tuple[int, dict, bytes]:
    with connect(port, source, timeout) as sock:
        sock.sendall(raw)
        return read_answer(sock)


def post(port: int, target: str, body: bytes, extra: str = "", source: str | None = None) -> tuple[int, dict, bytes]:
    head = (f"POST {target} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n")
    return request(port, head.encode() + body, source)


def trickle_start(port: int, target: str, declared: int, source: str | None = None) -> socket.socket:
    """An upload that declares ``declared`` bytes and sends one; the caller sends the rest slowly."""
    sock = connect(port, source)
    sock.sendall(f"POST {target} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {declared}\r\n"
                 "Inference-Header-Content-Length: 2\r\n\r\n{".encode())
    return sock


def big_object() -> bytes:
    """The 9 MB JSON object of 450k keys that froze the door when parsed on its event loop."""
    return json.dumps({f"k{i:07d}": i for i in range(BIG_OBJECT_KEYS)}).encode()


@dataclass
class Probe:
    """``GET path`` (health by default) every ``interval_s`` on a fresh connection, until stopped."""

    port: int
    interval_s: float = 0.05
    source: str | None = None
    path: str = "/v2/health/live"
    latencies: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)

    def start(self) -> Probe:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                status, _, _ = request(self.port, f"GET {self.path} HTTP/1.1\r\nHost: localhost\r\n"
                                       "Connection: close\r\n\r\n"
                                       .encode(), self.source, timeout=30)
            except OSError as exc:
                status = type(exc).__name__
            self.latencies.append(time.monotonic() - began)
            self.statuses[status] += 1
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - began)))

    def stop(self) -> Probe:
        self._stop.set()
        self._thread.join(timeout=60)
        return self

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    def summary(self) -> str:
        return (f"{self.path}: {len(self.latencies)} requests, p50 {self.percentile(0.5) * 1000:.1f} ms, "
                f"p99 {self.percentile(0.99) * 1000:.1f} ms, max {max(self.latencies, default=0) * 1000:.1f} ms, "
                f"statuses {dict(self.statuses)}")


class Attacks:
    """The attacks of the module's docstring, each on its own threads, until ``stop``."""

    def __init__(self, port: int, model: str, idle: int = 256, trickles: int = 3, posters: int = 3,
                 declared: int = 128 << 20, trickle_every_s: float = 10.0,
                 sources: tuple[str | None, str | None, str | None] = ATTACKERS) -> None:
        """``sources``: the addresses the idle connections, the trickles and the posters come from
        (the door's bounds per client are per address; None: 127.0.0.1)."""
        self.port, self.model, self.idle, self.trickles, self.posters = port, model, idle, trickles, posters
        self.declared, self.trickle_every_s, self.sources = declared, trickle_every_s, sources
        self.answers: Counter = Counter()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._idle_flood, daemon=True),
                         *(threading.Thread(target=self._trickle, daemon=True) for _ in range(trickles)),
                         *(threading.Thread(target=self._poster, args=(i,), daemon=True) for i in range(posters))]
        self._body = big_object() if posters else b""

    def start(self) -> Attacks:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> Attacks:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        return self

    def _note(self, what: str, status: object) -> None:
        self.answers[f"{what} {status}"] += 1

    def _idle_flood(self) -> None:
        """``idle`` open connections that never send a byte, reopened as the door drops them."""
        socks: list[socket.socket] = []
        while not self._stop.is_set():
            socks = [s for s in socks if not _closed(s)]
            while len(socks) < self.idle and not self._stop.is_set():
                try:
                    socks.append(connect(self.port, self.sources[0], timeout=0.2))
                except OSError as exc:
                    self._note("idle connect", type(exc).__name__)
                    break
            self._stop.wait(0.5)
        for sock in socks:
            sock.close()

    def _trickle(self) -> None:
        while not self._stop.is_set():
            try:
                sock = trickle_start(self.port, f"/v2/models/{self.model}/infer", self.declared, self.sources[1])
                while not self._stop.is_set() and not _closed(sock, wait=self.trickle_every_s):
                    sock.sendall(b" ")
                status, _, _ = read_answer(sock) if not self._stop.is_set() else (None, None, None)
                sock.close()
                if status is not None:
                    self._note("trickle", status)
            except OSError as exc:
                self._note("trickle", type(exc).__name__)
            self._stop.wait(1.0)  # and again: each attempt holds what it can

    def _poster(self, index: int) -> None:
        routes = (f"/v2/models/{self.model}/generate", f"/v2/models/{self.model}/infer")
        turn = index
        while not self._stop.is_set():
            try:
                status, _, _ = post(self.port, routes[turn % 2], self._body, source=self.sources[2])
            except OSError as exc:
                status = type(exc).__name__
            self._note(f"9 MB JSON to {routes[turn % 2].rsplit('/', 1)[1]}", status)
            turn += 1


def _closed(sock: socket.socket, wait: float = 0.0) -> bool:
    """Whether the door has closed (or answered on) ``sock``, waiting up to ``wait`` s to see."""
    sock.settimeout(wait or 0.001)
    try:
        sock.recv(1, socket.MSG_PEEK)  # an answer or the end: either way the door is done with it
        return True
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--model", default="neopp_dense")
    args = parser.parse_args()
    baseline = Probe(args.port).start()
    time.sleep(min(5.0, args.seconds / 4))
    print("no attack:", baseline.stop().summary())
    probe = Probe(args.port).start()
    attacks = Attacks(args.port, args.model).start()
    time.sleep(args.seconds)
    attacks.stop()
    print("attacked: ", probe.stop().summary())
    print("attacks were answered:", dict(attacks.answers))


if __name__ == "__main__":
    main()
