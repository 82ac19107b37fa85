"""Free loopback ports for servers and rank rendezvous (written once for every caller)."""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

LOOPBACK = "127.0.0.1"
LOWEST = 10000  # above the well-known and common service ports


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for port-0 binds and outgoing connections (Linux default 32768-60999)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(count: int = 1, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct ports that bind now, chosen below the kernel's ephemeral range.

    A server binds its ports only once its models have loaded, a minute later on a busy machine;
    meanwhile rank processes open many connections and port-0 binds, all from the ephemeral
    range, so a port picked there can be taken. Below it only explicit binds compete.
    """
    low = ephemeral_range()[0]
    if low - LOWEST < 100 * count:  # an unusual range: let the kernel choose
        return _kernel_ports(count, host)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    socks: list[socket.socket] = []
    try:
        for port in rng.sample(range(LOWEST, low), min(low - LOWEST, 50 * count)):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            if len(socks) == count:
                return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()
    return _kernel_ports(count, host)


def _kernel_ports(count: int, host: str) -> list[int]:
    """Ports the kernel picks (sockets held together so they differ)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()
