"""``python -m neopp.launcher serve``'s command line, and the door's bounds read from it.

Why apart from the supervisor: the flags are the launcher's public surface (``--help``, the
deployment docs, the tests that build a launcher's arguments), while the supervisor is what runs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..ports import LOOPBACK
from .door.bounds import DoorLimits, KiB, MiB

API_KEY_ENV = "NEOPP_API_KEY"
ALLOWED_HOSTS_ENV = "NEOPP_ALLOWED_HOSTS"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def door_limits(ns: argparse.Namespace) -> DoorLimits:
    """The door's bounds from the command line."""
    return DoorLimits(max_body=int(ns.max_body_mib * MiB), bodies_in_flight=int(ns.bodies_in_flight_mib * MiB),
                      client_bodies=int(min(ns.client_bodies_mib, ns.bodies_in_flight_mib) * MiB),
                      read_timeout_s=ns.read_timeout_s, min_upload_rate=ns.min_upload_kib_s * KiB,
                      idle_timeout_s=ns.idle_timeout_s, max_connections=ns.max_connections,
                      max_client_connections=ns.max_client_connections, max_inference=ns.max_inference,
                      client_inference=ns.client_inference,
                      region_min_bytes=int(ns.tensor_region_min_kib * KiB),
                      allowed_hosts=allowed_hosts(ns))


def allowed_hosts(ns: argparse.Namespace) -> frozenset[str] | None:
    """The Host names the door answers: as given, else the loopback names on loopback (a web page
    rebinding a name to 127.0.0.1 is refused), else any (beyond loopback the API key is required)."""
    from .door.browser_guard import parse_hosts

    given = ns.allowed_hosts or os.environ.get(ALLOWED_HOSTS_ENV, "")
    if given:
        return parse_hosts(given)
    return parse_hosts("loopback") if ns.host in LOCAL_HOSTS else None


# The door's bounds: (flag, type, default, help), each a field of DoorLimits or its budget.
_DOOR_BOUNDS: tuple[tuple[str, type, float, str], ...] = (
    ("--max-body-mib", float, 128.0,
     "largest HTTP body accepted (after gzip)"),
    ("--bodies-in-flight-mib", float, 384.0,
     "HTTP request bodies held at once, all requests together (beyond: 503, Retry-After)"),
    ("--client-bodies-mib", float, 128.0,
     "of those, what one client address may hold (beyond: 503, Retry-After)"),
    ("--min-upload-kib-s", float, 1024.0,
     "the average rate an HTTP upload must keep up"),
    ("--read-timeout-s", float, 10.0,
     "how far an HTTP upload may fall behind --min-upload-kib-s before the door drops it (408)"),
    ("--idle-timeout-s", float, 15.0,
     "an HTTP connection's wait for a complete request head, after opening or its last answer"),
    ("--max-connections", int, 1024,
     "open HTTP connections; at the cap a new one replaces an idle one (none idle: 503); also the gRPC "
     "front's open calls (beyond: RESOURCE_EXHAUSTED)"),
    ("--max-client-connections", int, 512,
     "open HTTP connections (and gRPC front calls) of one client address; at the cap as --max-connections"),
    ("--max-inference", int, 768,
     "HTTP inference requests in flight (beyond: 503, Retry-After); health and metrics not counted"),
    ("--client-inference", int, DoorLimits.client_inference,
     "generations one client (address) may have running or queued over HTTP; past it 429 with "
     "Retry-After (0: no limit)"),
)


def add_arguments(s: argparse.ArgumentParser, default_repo: str, default_key: str,
                  backend_help: str) -> None:
    s.add_argument("--model-repository", default=default_repo)
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--host", default=LOOPBACK, help="bind address (0.0.0.0 exposes the server)")
    s.add_argument("--backend-dir", default=None, help=backend_help)
    s.add_argument("--ready-timeout", type=float, default=600.0)
    s.add_argument("--grpc-front", action=argparse.BooleanOptionalAction, default=True,
                   help="serve the public gRPC port through the launcher's gRPC front "
                        "(neopp.launcher.door.grpc_front); "
                        "--no-grpc-front: Triton's own gRPC port is the public one, so a router's retry on a "
                        "refused connection sends requests past a dead server (deploy/router.py)")
    s.add_argument("--no-watchdog", action="store_true",
                   help="do not replace a model's dead, stopped or hung Python stub (see neopp.launcher.watchdog)")
    s.add_argument("--reload-timeout-s", type=float, default=300.0,
                   help="a model reload by the watchdog that takes longer restarts tritonserver")
    s.add_argument("--hung-s", type=float, default=60.0,
                   help="requests for a model waiting this long while the server makes no progress and that "
                        "model's stubs use no CPU: they are hung and replaced")
    s.add_argument("--stopped-s", type=float, default=1.0,
                   help="a stub stopped by a signal (SIGSTOP, a debugger) this long is replaced: Triton gives up "
                        "on it after a second, and it aborts the server if it runs again")
    s.add_argument("--alive-file", default=None,
                   help="touched every 5 s while the launcher's HTTP door answers: what a liveness probe reads")
    s.add_argument("--admin-key-file", default=default_key,
                   help="operator key file, created 0600 if missing ($NEOPP_ADMIN_KEY wins)")
    s.add_argument("--max-restarts", type=int, default=5,
                   help="restarts of a server that died allowed within --restart-window-s")
    s.add_argument("--restart-window-s", type=float, default=600.0, help="the window --max-restarts counts in")
    s.add_argument("--stop-timeout-s", type=float, default=None,
                   help="at a stop, how long running requests may finish before the stubs are told to stop "
                        "(also tritonserver's --exit-timeout-secs unless given); default: 10 s, killed at 30 s")
    for flag, kind, default, text in _DOOR_BOUNDS:
        s.add_argument(flag, type=kind, default=default, help=text)
    s.add_argument("--server-nice", type=int, default=0, choices=range(0, 20), metavar="0..19",
                   help="run tritonserver and its stubs this much nicer than the launcher, so that the door "
                        "answers health checks first when the CPUs are busy (default 0)")
    s.add_argument("--api-key-file", default=str(Path("build") / "api.key"),
                   help=f"the inference API key, created 0600 if missing, used when --host is beyond loopback "
                        f"(${API_KEY_ENV} wins, and applies on loopback too)")
    s.add_argument("--tensor-region-min-kib", type=float, default=1024.0,
                   help="binary HTTP inputs this large reach Triton through the door's shared-memory region "
                        "instead of inside the gRPC request (0: never)")
    s.add_argument("--allowed-hosts", default=None,
                   help=f"comma-separated Host names the HTTP port answers ('loopback' for every loopback name, "
                        f"'*' for any); default ${ALLOWED_HOSTS_ENV}, else loopback when --host is loopback, else any")
    s.add_argument("extra", nargs=argparse.REMAINDER, help="after --: extra tritonserver arguments")

