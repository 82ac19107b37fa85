"""``python -m neopp.launcher serve``: tritonserver behind safe defaults, kept up.

* The administrative APIs (model repository, config, shared memory, trace, logging) need the
  operator key (``$NEOPP_ADMIN_KEY`` or a 0600 file created at first start); the stub watchdog
  sends it when it reloads a model.
* The public HTTP port is the door (neopp.launcher.door): it parses every request itself and sends
  inference to Triton over gRPC; the public gRPC port is the gRPC front (neopp.launcher.door.grpc_front),
  which relays what it parsed. Triton's own HTTP and gRPC listen on Unix sockets in a directory
  only the server's user can enter (neopp.launcher.inner_http), so no other local user reaches them.
* A server that dies is restarted with backoff, at most ``--max-restarts`` times within
  ``--restart-window-s`` (a rate, not a lifetime budget); each restart is logged and counted on
  the door's ``/metrics``. So is one the stub watchdog asks for (a reload that did not finish
  within ``--reload-timeout-s``, a stub that could not be killed safely). Every stop and restart
  removes the Python backend regions that server owned in ``/dev/shm``.
* Health comes from what the launcher knows (``health``): the door's readiness says whether the
  server can serve now, and ``--alive-file`` is touched while the door's event loop answers, for
  a liveness probe that never connects to the public port.
* A model that fails to load does not stop the others: once the server is up, a table says
  which models are READY and why each other one is not; the launcher gives up (exit code 1)
  only when no model loaded.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from ..ports import LOOPBACK
from .admin import GRPC_API_KEY_HEADER, KEY_ENV, KEY_HEADER, check_key, load_or_create_key
from .allocator import return_large_buffers
from .health import ServerHealth, touch
from .inner_http import grpc_beside, private_address, remove_private
from .model_states import KEEP_GOING_ARGS, repository_index, state_table
from .poller import Poller
from .serve_options import API_KEY_ENV, LOCAL_HOSTS, door_limits
from .shm_regions import DEFAULT_REGION_BYTES, GROWTH_BYTES
from .tritonserver import TritonServer, grpc_socket_target, metrics_client_host


def log(message: str) -> None:
    print(message, flush=True)


class RestartRate:
    """At most ``limit`` restarts within any ``window_s``: a server that crashes now and then is
    always brought back, one that crashes in a loop is given up on."""

    def __init__(self, limit: int, window_s: float, clock=time.monotonic) -> None:
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self.times: deque[float] = deque()

    def allow(self) -> bool:
        """True (and the restart counted) when one more restart fits in the window."""
        now = self.clock()
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        return True


def server_args(ns: argparse.Namespace, extra: Sequence[str]) -> list[str]:
    """The tritonserver arguments after ``--``; with ``--stop-timeout-s``, Triton waits as long
    for running requests at a stop (unless the arguments set its exit timeout themselves)."""
    args = list(extra)
    if ns.stop_timeout_s is not None and not any(a.startswith("--exit-timeout-secs") for a in args):
        args.append(f"--exit-timeout-secs={int(ns.stop_timeout_s)}")
    return args


class Supervisor:
    """Start the server, restart it when it dies, stop everything on request."""

    def __init__(self, ns: argparse.Namespace, extra: Sequence[str], key: str) -> None:
        self.ns, self.extra, self.key = ns, server_args(ns, extra), key
        self.inner_http = private_address()  # Triton's own HTTP, for the door and the launcher alone
        self.inner_grpc = grpc_beside(self.inner_http)  # Triton's own gRPC, behind the gRPC front
        self.stop_requested = False
        self.restarts = RestartRate(ns.max_restarts, ns.restart_window_s)
        self.server: TritonServer | None = None
        self.watchdog = None
        self.health = ServerHealth()
        grpc_host = LOOPBACK if ns.host in ("0.0.0.0", "", "::") else ns.host
        from .door.grpc_front import GrpcFront
        from .door.server import DoorServer  # needs the serve extra (uvicorn, starlette, grpc)

        self.api_key = api_key_for(ns)
        limits = door_limits(ns)
        inner_grpc = grpc_socket_target(self.inner_grpc) if ns.grpc_front else f"{grpc_host}:{ns.grpc_port}"
        self.front = DoorServer(ns.host, ns.http_port, inner_grpc, self.inner_http, None,
                                limits, health=self.health, admin_key=key,
                                api_key=self.api_key, metrics_address=(metrics_client_host(ns.host), ns.metrics_port),
                                public_grpc_port=ns.grpc_port)
        self.grpc_front = None if not ns.grpc_front else GrpcFront(
            _listen_address(ns.host, ns.grpc_port), inner_grpc, limits.max_body, self.health, self.api_key,
            self.front.door.clients, self.front.door.budget, max_calls=limits.max_connections,
            max_client_calls=limits.max_client_connections)
        self.alive = None if ns.alive_file is None else Poller(
            "neopp-alive", 5.0, lambda: self.answers(2.0) and touch(Path(ns.alive_file)), lambda exc: None)

    def answers(self, timeout_s: float) -> bool:
        """True when both fronts' event loops answer (neither is stuck)."""
        return self.front.answers(timeout_s) and (self.grpc_front is None or self.grpc_front.answers(timeout_s))

    def _new_server(self) -> TritonServer:
        ns = self.ns
        return TritonServer(ns.model_repository, grpc_address=self.inner_grpc if ns.grpc_front else None,
                            grpc_port=ns.grpc_port,
                            metrics_port=ns.metrics_port, host=ns.host, http_address=self.inner_http,
                            backend_dir=ns.backend_dir, extra_args=[*KEEP_GOING_ARGS, *self.extra], admin_key=self.key,
                            shm_sizes=(DEFAULT_REGION_BYTES, GROWTH_BYTES), env=without_keys(os.environ),
                            api_key=self.api_key, nice=ns.server_nice)

    def _start_server(self) -> None:
        self.health.server_down("tritonserver is starting")
        self.server = self._new_server().start()
        log(f"tritonserver {self.server.install.server_bin}")
        log(f"tritonserver pid {self.server.process.pid}, own HTTP on {self.inner_http} "
            f"(the door's alone), shm region prefix {self.server.shm_prefix}")

    def _stop_server(self) -> None:
        """The watchdog acts no more, the server stops (a reload in progress ends with it), then the
        watchdog's thread ends."""
        self.health.server_down("tritonserver is stopping")
        if self.watchdog is not None:
            self.watchdog.halt()
        if self.server is not None:
            drain = self.ns.stop_timeout_s
            if drain is None:
                self.server.stop()
            else:
                self.server.stop(timeout=drain + 20.0, drain_s=drain)
            if self.server.removed_regions:
                log(f"removed {len(self.server.removed_regions)} shm region(s) left by the server")
            self.server = None
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.ns.ready_timeout
        while not self.stop_requested and time.monotonic() < deadline:
            if self.server.process.poll() is not None:
                return False
            if self.server.is_ready():
                self.health.server_up()
                self.watchdog = _start_watchdog(self.server, self.extra, self.ns, self.key, self.health)
                return True
            time.sleep(0.5)
        return False

    def _report_models(self) -> bool:
        """Print every model's state; True when at least one is READY (worth serving)."""
        try:
            states = repository_index(self.inner_http, {KEY_HEADER: self.key})
        except OSError as exc:
            log(f"could not read the model repository index: {exc}")
            return False
        log("models:\n" + state_table(states))
        return any(s.ready for s in states)

    def _announce(self) -> None:
        url, grpc = f"{self.server.client_host}:{self.ns.http_port}", f"{self.server.client_host}:{self.ns.grpc_port}"
        log(f"\nNeoPP Triton server ready:\n"
            f"  export NEOPP_URL=http://{url}   (every client here finds the server through it)\n"
            f"  page     http://{url}/  (the playground)\n"
            f"  neopp    NEOPP_URL=http://{url} .venv/bin/neopp generate \"a red circle on the left on a blue "
            f"background\" -o outputs/red.png\n"
            f"  HTTP     http://{url}  (client_examples/http_t2i.py --url {url})\n"
            f"  gRPC     {grpc}  (client_examples/grpc_t2i.py --url {grpc})\n"
            f"  metrics  {self.server.metrics_url}\nCtrl-C stops it.")

    def _wait_exit(self) -> tuple[int | None, str] | None:
        """Block until a stop request (None), the server's exit (its code and why) or a restart the
        watchdog asked for (no code, its reason)."""
        while not self.stop_requested:
            code = self.server.process.poll()
            if code is not None:
                return code, f"signal {-code}" if code < 0 else f"exit code {code}"
            if (asked := self.health.take_restart()) is not None:
                return None, asked
            time.sleep(0.5)
        return None

    def run(self) -> int:
        self.front.start()
        if self.grpc_front is not None:
            self.grpc_front.start()
        if self.alive is not None:
            self.alive.start()
        try:
            return self._loop()
        finally:
            if self.alive is not None:
                self.alive.stop(timeout_s=5)
            self._stop_server()
            if self.grpc_front is not None:
                self.grpc_front.stop()
            self.front.stop()
            remove_private(self.inner_http)

    def _loop(self) -> int:
        first = True
        while True:
            self._start_server()
            if not self._wait_ready():
                if self.stop_requested:
                    return 0
                log(f"tritonserver not ready (exit code {self.server.process.poll()}); stopping")
                return 1
            self.server.retry_rescued()
            if not self._report_models():
                log("no model is ready; stopping")
                return 1
            if first:
                self._announce()
                first = False
            ended = self._wait_exit()
            if ended is None:
                log("stopping tritonserver ...")
                return 0
            if not self._restart_after(*ended):
                return ended[0] or 1

    def _restart_after(self, code: int | None, reason: str) -> bool:
        """Log the death (or why the server is restarted), clean up, and wait the backoff; False
        when the restart rate is exceeded."""
        if code is None:
            log(f"restarting tritonserver: {reason}")
            reason = "watchdog"
        else:
            log(f"tritonserver exited with code {code} ({reason})")
        self._stop_server()
        self.health.server_down(f"tritonserver is restarting ({reason})")
        window = self.ns.restart_window_s
        if not self.restarts.allow():
            log(f"not restarting: {len(self.restarts.times)} restarts within the last {window:.0f}s "
                f"(--max-restarts {self.ns.max_restarts} per --restart-window-s {window:.0f})")
            return False
        self.front.metrics.restart(reason)
        count = len(self.restarts.times)
        delay = min(30.0, 2.0 ** (count - 1))
        log(f"restarting tritonserver in {delay:.0f}s ({reason}; restart {count} of {self.ns.max_restarts} "
            f"allowed within {window:.0f}s)")
        deadline = time.monotonic() + delay
        while not self.stop_requested and time.monotonic() < deadline:
            time.sleep(0.1)
        return not self.stop_requested


def _listen_address(host: str, port: int) -> str:
    """``host:port`` as gRPC binds it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def api_key_for(ns: argparse.Namespace, env: dict[str, str] | None = None) -> str | None:
    """The key every inference route requires (the door's and gRPC): $NEOPP_API_KEY, else, when
    the server listens beyond loopback, the key file (created 0600 at first start); on loopback
    alone none."""
    env = os.environ if env is None else env
    if env.get(API_KEY_ENV):
        log(f"inference API key from ${API_KEY_ENV}")
        return check_key(env[API_KEY_ENV].strip(), API_KEY_ENV)
    if ns.host in LOCAL_HOSTS:
        return None
    key, where = load_or_create_key(Path(ns.api_key_file), env={})
    log(f"inference API key (Authorization: Bearer; over gRPC the header {GRPC_API_KEY_HEADER}) from {where}: "
        "the server listens beyond loopback")
    return key


def without_keys(env: dict[str, str]) -> dict[str, str]:
    """The server's environment: ours without the key variables (its models need neither key)."""
    return {k: v for k, v in env.items() if k not in (KEY_ENV, API_KEY_ENV)}


def _start_watchdog(server: TritonServer, extra: Sequence[str], ns: argparse.Namespace, key: str,
                    health: ServerHealth):
    """Replace a model's dead, stopped or hung stub (Triton 2.51 does not); needs explicit model control."""
    if ns.no_watchdog or "--model-control-mode=explicit" not in extra or server.process is None:
        return None
    from .watchdog import start_watchdog

    metrics = None if any(a in ("--allow-metrics=false", "--allow-metrics=0") for a in extra) else server.metrics_url
    return start_watchdog(server.grpc_url, server.process.pid, log=log, admin_key=key, health=health,
                          metrics_url=metrics, reload_timeout_s=ns.reload_timeout_s, hung_s=ns.hung_s,
                          stopped_s=ns.stopped_s)


def serve(ns: argparse.Namespace) -> int:
    return_large_buffers()
    extra = ns.extra[1:] if ns.extra[:1] == ["--"] else list(ns.extra)
    key, where = load_or_create_key(Path(ns.admin_key_file))
    log(f"admin key (header '{KEY_HEADER}' for model load/unload, config, shared memory) from {where}")
    supervisor = Supervisor(ns, extra, key)

    def _on_signal(signum: int, _frame: object) -> None:
        supervisor.stop_requested = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return supervisor.run()
