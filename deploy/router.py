"""The load balancer in front of the replicas: HAProxy, one set of routing rules for every place.

    python -m deploy.router --kubernetes > deploy/kubernetes/base/router/haproxy.cfg   (make router-config)

The same rules serve `make serve-replicas` (servers listed by address) and the cluster (servers
found through the replicas' headless Service); a test checks the committed cluster file against
this rendering. The rules:

* gRPC (HTTP/2, Triton's port 8001) and HTTP (the door, 8000) are balanced on the header
  ``neopp-session`` (a chat's Triton sequence id, sent by the LightLLM client on every session
  request) with a consistent hash: every turn of a chat reaches the replica that holds its session,
  and a replica that goes away moves only its own chats. Requests without the header (stateless
  turns, plain generations) go round-robin.
* A replica is in the pool while its door answers ``GET /v2/health/ready`` (the launcher's
  readiness: the server is up and no model has a dead, stopped, hung or reloading stub),
  checked every 500 ms; two misses take it out, so new
  requests reach the others within about a second of a crash. A request whose connection to a
  replica fails before it was sent is sent to another one (``retry-on conn-failure``); one that
  was already running there fails (gRPC UNAVAILABLE / HTTP 502): it is never sent twice. In the
  moment between a replica's death and the router noticing it, a gRPC call on the router's
  connection to it is refused (REFUSED_STREAM, never processed): a client sends it once more.
  This needs each replica's gRPC port to be Triton's own (the launcher's ``--no-grpc-front``, which
  ``deploy.replicas`` and the Kubernetes manifests set): a relay that outlives a dead server would
  accept the connection and answer UNAVAILABLE instead.
* Timeouts are longer than the longest image (15 minutes).
* gRPC messages are bounded here, since Triton 2.51 takes up to 2 GiB and has no option to lower
  it: every gRPC message starts with 5 bytes (a compression flag, then its length, big-endian);
  the router reads a request's first message prefix and refuses a message over
  ``MAX_GRPC_MESSAGE`` (HTTP/2 status 413, which gRPC clients report as UNKNOWN "Received http2
  header with status: 413") before a replica sees a byte of it. A unary call (``ModelInfer``:
  every generation and session turn) whose prefix does not arrive within 10 s is refused too
  (408), so a trickle cannot pass unchecked. Later messages of a stream (``ModelStreamInfer``) are
  not read here. HTTP bodies are bounded by each replica's door.
* The cluster router's statistics: the Prometheus exporter on ``STATS_PORT`` (``/metrics`` only,
  for the monitoring namespace the NetworkPolicy admits) and HAProxy's stats page on the pod's
  loopback only (``kubectl port-forward``), never on the client ports.
* Every router pod lists the same servers under the same names: the replicas are a StatefulSet,
  server ``rI`` is pod ``neopp-I`` (its stable DNS name), so all router pods hash a chat to the
  same replica. Slots whose pod does not exist (fewer replicas now) are simply down.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

ROUTE_HEADER = "neopp-session"
CHECK = "GET /v2/health/ready"
NAMESPACE = "neopp"  # the manifests' namespace (HAProxy's resolver does not apply DNS search domains)
REPLICAS_SERVICE = f"neopp-replicas.{NAMESPACE}.svc.cluster.local"  # the replicas' headless Service
MAX_REPLICAS = 16  # replica pods neopp-0 .. neopp-15 the cluster router lists (the autoscaler's maximum)
MAX_GRPC_MESSAGE = 256 * 2**20  # bytes: the models' max_request_bytes (every input of one request)
PREFIX_WAIT_S = 10  # how long a gRPC request's first message prefix may take to arrive
UNARY_INFER = "/inference.GRPCInferenceService/ModelInfer"
STATS_PORT = 8404  # the cluster router's Prometheus exporter (/metrics)
STATS_PAGE = "127.0.0.1:8405"  # its stats page: the pod's loopback only


@dataclass(frozen=True)
class Replica:
    """One replica's address: its gRPC port and its door's HTTP port (which the health check reads)."""

    host: str
    grpc_port: int
    http_port: int


def _global(stats_port: int | None) -> list[str]:
    lines = ["global", "    log stdout format raw local0 info", "    maxconn 4096", "",
             "defaults", "    mode http", "    log global", "    option httplog", "    timeout connect 2s",
             "    timeout client 15m", "    timeout server 15m", "    timeout http-request 60s",
             "    timeout check 2s", "    option redispatch", "    retries 2", "    retry-on conn-failure",
             f"    balance hdr({ROUTE_HEADER})", "    hash-type consistent", f"    option httpchk {CHECK}",
             "    http-check expect status 200", "    default-server inter 500ms fall 2 rise 2", ""]
    if stats_port is not None:
        lines += ["frontend metrics", f"    bind :{stats_port}", "    http-request use-service prometheus-exporter "
                  "if { path /metrics }", "    http-request deny deny_status 404", "",
                  "frontend stats_page", f"    bind {STATS_PAGE}", "    stats enable", "    stats uri /stats", ""]
    return lines


def _frontends(bind: str, grpc_port: int, http_port: int, max_grpc_message: int, prefix_wait_s: float) -> list[str]:
    return ["frontend grpc", f"    bind {bind}:{grpc_port} proto h2",
            "    # the first gRPC message's prefix: a flag byte, then its length (4 bytes, big-endian)",
            f"    http-request wait-for-body time {int(prefix_wait_s * 1000)}ms at-least 5",
            "    acl grpc_prefix req.body_size ge 5",
            f"    http-request deny deny_status 408 if {{ path {UNARY_INFER} }} !grpc_prefix",
            "    http-request deny deny_status 413 if grpc_prefix "
            f"{{ req.body,bytes(1,4),be2dec(:,4) -m int gt {max_grpc_message} }}",
            "    default_backend grpc_replicas", "",
            "frontend http", f"    bind {bind}:{http_port}", "    default_backend http_replicas", ""]


def render_local(replicas: Sequence[Replica], bind: str, grpc_port: int, http_port: int,
                 stats_port: int | None = None, max_grpc_message: int = MAX_GRPC_MESSAGE,
                 prefix_wait_s: float = PREFIX_WAIT_S) -> str:
    """The router of `make serve-replicas`: each replica listed by address (the limits: see the module)."""
    grpc = [f"    server r{i} {r.host}:{r.grpc_port} proto h2 check port {r.http_port} check-proto h1"
            for i, r in enumerate(replicas)]
    http = [f"    server r{i} {r.host}:{r.http_port} check" for i, r in enumerate(replicas)]
    lines = [*_global(stats_port), *_frontends(bind, grpc_port, http_port, max_grpc_message, prefix_wait_s),
             "backend grpc_replicas", *grpc, "", "backend http_replicas", *http, ""]
    return "\n".join(lines)


def render_kubernetes() -> str:
    """The cluster's router: replica pods neopp-0 .. neopp-(MAX_REPLICAS - 1) by their stable names."""
    pods = [f"neopp-{i}.{REPLICAS_SERVICE}" for i in range(MAX_REPLICAS)]
    found = "resolvers kube init-addr none"
    grpc = [f"    server r{i} {pod}:8001 proto h2 check port 8000 check-proto h1 {found}" for i, pod in enumerate(pods)]
    http = [f"    server r{i} {pod}:8000 check {found}" for i, pod in enumerate(pods)]
    lines = [*_global(STATS_PORT), "resolvers kube", "    parse-resolv-conf", "    hold valid 5s", "",
             *_frontends("", 8001, 8000, MAX_GRPC_MESSAGE, PREFIX_WAIT_S),
             "backend grpc_replicas", *grpc, "", "backend http_replicas", *http, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubernetes", action="store_true", help="the cluster's configuration (the default)")
    parser.parse_args(argv)
    sys.stdout.write(render_kubernetes())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
