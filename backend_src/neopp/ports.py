"""Free loopback ports for servers and rank rendezvous (written once for every caller)."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_ports(count: int = 1, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct ports the OS reports free now (sockets held together so they differ).

    A small race remains until the caller binds; callers that can bind port 0 themselves should.
    """
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
