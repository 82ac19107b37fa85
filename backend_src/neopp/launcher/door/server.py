"""The door on its own thread: uvicorn (h11) serving the ASGI application on the public port.

uvicorn because it is the common ASGI server, small, with a pure-Python HTTP/1.1 parser (h11)
whose bounds are explicit; its connections are the door's own (``connections.DoorProtocol``:
timeouts, caps per client, the head limit). Starlette because the door needs routing and
streaming responses and nothing more (FastAPI would add validation models we do not use: the
door validates with its own strict rules).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import threading
import time

import uvicorn

from ..health import loop_answers
from .app import Door, Health
from .bounds import HEADER_LIMIT, DoorLimits
from .browser_guard import BrowserGuard
from .connections import ConnectionTable, DoorProtocol, HeadLimit
from .door_metrics import DoorMetrics
from .parse_jobs import Parser
from .routes import build_app
from .shm_arena import ShmArena, TensorRegion
from .upstream import Upstream

LOG = logging.getLogger("neopp.launcher.door")


class DoorServer:
    """Listen on ``(host, port)``; send inference to ``grpc_target``, control to ``http_address``."""

    def __init__(self, host: str, port: int, grpc_target: str, http_address: tuple[str, int] | str,
                 front_key: str | None,
                 limits: DoorLimits | None = None, metrics: DoorMetrics | None = None,
                 health: Health | None = None, admin_key: str | None = None,
                 api_key: str | None = None, parse_workers: int = 2,
                 metrics_address: tuple[str, int] | None = None, public_grpc_port: int | None = None) -> None:
        """``admin_key``: to register the tensor region and read the model list where Triton
        restricts them, and what the door asks of administrative routes; ``api_key``: what every
        inference route requires (None: nothing), and what the door sends Triton's gRPC inference;
        ``health``: what the launcher knows of the server (readiness, requests it cannot serve now);
        ``metrics_address``: Triton's metrics port, which ``/status`` reads; ``public_grpc_port``: the
        gRPC port clients are told, where it is not ``grpc_target``'s (the launcher's gRPC front)."""
        self.limits = limits or DoorLimits()
        self.metrics = metrics or DoorMetrics()
        self.upstream = Upstream(grpc_target, http_address, front_key, api_key)
        self.parser = Parser(parse_workers)
        arena = ShmArena(self.limits.bodies_in_flight) if self.limits.region_min_bytes else None

        async def register(name: str, key: str, size: int) -> None:
            await self.upstream.register_region(name, key, size, admin_key)

        self.region = TensorRegion(arena, register, self.limits.region_min_bytes, self.limits.max_json_bytes,
                                   LOG.warning)
        self.door = Door(self.upstream, self.limits, self.metrics, self.region, health, self.parser,
                         api_key, admin_key, metrics_address, public_grpc_port)
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.server_address = self.sock.getsockname()[:2]
        protocol = functools.partial(DoorProtocol, table=ConnectionTable(self.limits, self.metrics))
        app = BrowserGuard(HeadLimit(build_app(self.door), self.metrics), self.limits.allowed_hosts)
        config = uvicorn.Config(app, loop="asyncio", http=protocol,
                                lifespan="off", access_log=False, log_level="warning", log_config=None,
                                server_header=False, timeout_keep_alive=self.limits.idle_timeout_s,
                                h11_max_incomplete_event_size=HEADER_LIMIT, timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        if not LOG.handlers:
            LOG.addHandler(logging.StreamHandler())

    def start(self) -> DoorServer:
        self.parser.start()
        self._thread = threading.Thread(target=self._run, name="neopp-http-door", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self._server.started:
            raise RuntimeError("the HTTP door did not start")
        return self

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        health = asyncio.ensure_future(self.door.health_cache.run())
        try:
            await self._server.serve(sockets=[self.sock])
        finally:
            health.cancel()
            await self.upstream.close()

    def answers(self, timeout_s: float) -> bool:
        """True when the door's event loop runs a no-op within ``timeout_s`` (it is not stuck)."""
        return loop_answers(self._loop, self._thread, timeout_s)

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        self.sock.close()
        self.region.close()
        self.parser.close()
