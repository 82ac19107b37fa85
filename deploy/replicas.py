"""Several NeoPP replicas on one machine behind HAProxy, routed as the cluster routes them.

    python -m deploy.replicas [--replicas 2] [--http-port 8000] [--grpc-port 8001]   (make serve-replicas N=2)

Each replica is the launcher `make serve` runs (tritonserver, the door, restarts off so that a
crash stays a crash), on free loopback ports, with the same operator key; HAProxy listens on the
public ports with `deploy.router`'s rules. Ctrl-C (or SIGTERM) stops the router and every replica.
Clients use the router's addresses exactly as they use one server's.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from neopp.ports import LOOPBACK, free_ports
from neopp.procs import process_group_members

from .router import Replica, render_local

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "demo" / "checkpoints"
DEFAULT_MODELS = ("neopp_dense", "neopp_dense_8steps", "neopp_session", "neopp_prompt_encoder", "neopp_t2i")
SERVER_PID = re.compile(r"tritonserver pid (\d+)")


@dataclass
class Running:
    """One replica: its launcher process, ports and output file."""

    replica: Replica
    proc: subprocess.Popen
    log: Path

    def server_pid(self) -> int | None:
        found = SERVER_PID.findall(self.log.read_text(errors="replace"))
        return int(found[-1]) if found else None

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.replica.host}:{self.replica.http_port}/v2/health/ready",
                                        timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False


@dataclass
class ReplicaSet:
    """N launchers and a router; ``start`` returns once every replica is ready and the router listens."""

    workdir: Path
    replicas: int = 2
    models: Sequence[str] = DEFAULT_MODELS
    env: dict[str, str] = field(default_factory=dict)
    http_port: int | None = None
    grpc_port: int | None = None
    running: list[Running] = field(default_factory=list)
    router: subprocess.Popen | None = None

    def url(self, kind: str) -> str:
        """The router's address for ``grpc`` or ``http`` clients."""
        return f"{LOOPBACK}:{self.grpc_port if kind == 'grpc' else self.http_port}"

    def start(self, timeout_s: float = 600.0) -> ReplicaSet:
        haproxy = shutil.which("haproxy")
        if haproxy is None:
            raise RuntimeError("haproxy is not installed (make deps installs Debian's)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        key = self.workdir / "admin.key"
        if not key.exists():
            key.write_text(secrets.token_hex(16))
            key.chmod(0o600)
        try:
            for i in range(self.replicas):
                self.running.append(self._launch(i, key))
            deadline = time.monotonic() + timeout_s
            while not all(r.ready() for r in self.running):
                dead = [r for r in self.running if r.proc.poll() is not None]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"replica did not start:\n{(dead or self.running)[0].log.read_text()[-3000:]}")
                time.sleep(0.5)
            self._route(haproxy)
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, index: int, key: Path) -> Running:
        http, grpc, metrics = free_ports(3)
        log = self.workdir / f"replica{index}.log"
        cmd = [sys.executable, "-m", "neopp.launcher", "serve", "--model-repository", str(REPO / "model_repository"),
               "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
               "--admin-key-file", str(key), "--max-restarts", "0", "--no-grpc-front", "--",
               "--model-control-mode=explicit", "--exit-timeout-secs=30", *(f"--load-model={m}" for m in self.models)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NEOPP_CHECKPOINT", "NEOPP_LORA_DIR"))}
        env.update({"NEOPP_CHECKPOINT": str(DEMO / "dense"), "NEOPP_LORA_DIR": str(DEMO / "lora"),
                    "NEOPP_CHECKPOINT_NEOPP_MOE": str(DEMO / "moe"), "PYTHONUNBUFFERED": "1", **self.env})
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                    start_new_session=True)
        return Running(Replica(LOOPBACK, grpc, http), proc, log)

    def _route(self, haproxy: str) -> None:
        if self.http_port is None or self.grpc_port is None:
            self.http_port, self.grpc_port = free_ports(2)
        config = self.workdir / "haproxy.cfg"
        config.write_text(render_local([r.replica for r in self.running], LOOPBACK, self.grpc_port, self.http_port))
        with open(self.workdir / "router.log", "wb") as out:
            self.router = subprocess.Popen([haproxy, "-db", "-f", str(config)], stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://{self.url('http')}/v2/health/ready", timeout=2):
                    return
            except OSError:
                if self.router.poll() is not None or time.monotonic() > deadline:
                    said = (self.workdir / "router.log").read_text()[-2000:]
                    raise RuntimeError(f"haproxy did not start: {said}") from None
                time.sleep(0.2)

    def crash(self, index: int) -> None:
        """Kill replica ``index``'s tritonserver and its stubs at once (the launcher does not restart it).

        Returns once none of them is alive: a process dies some time after SIGKILL, and until then
        its sockets still take requests, so "after the crash" starts here.
        """
        pid = self.running[index].server_pid()
        if pid is None:
            raise RuntimeError(f"replica {index} has no server to kill")
        os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while process_group_members(pid) and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            self.router.wait(timeout=10)
        for r in self.running:
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        for r in self.running:
            try:
                r.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait(timeout=10)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--workdir", type=Path, default=REPO / "build" / "replicas")
    args = parser.parse_args(argv)
    replicas = ReplicaSet(args.workdir, args.replicas, args.models, http_port=args.http_port, grpc_port=args.grpc_port)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        replicas.start()
        for i, r in enumerate(replicas.running):
            print(f"replica {i}: gRPC {r.replica.host}:{r.replica.grpc_port}, HTTP {r.replica.host}:"
                  f"{r.replica.http_port} (log {r.log})", flush=True)
        print(f"router: gRPC {replicas.url('grpc')}, HTTP {replicas.url('http')}; operator key "
              f"{args.workdir / 'admin.key'}; Ctrl-C stops everything", flush=True)
        while all(r.proc.poll() is None for r in replicas.running) and replicas.router.poll() is None:
            time.sleep(1)
        print("a replica or the router exited; stopping", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        replicas.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
