"""Bring a model back when its Python stub dies: Triton 2.51 itself does not.

Seen with the server this project runs (the nvidia-pytriton wheel's 2.51): after a model's
``triton_python_backend_stub`` is killed, the model stays READY in the repository index, a
request in flight fails with INTERNAL "Stub process '<instance>' is not healthy." and so does
every later request (each after a 1 s health check); the stub is never restarted. A plain
``load_model`` of an unchanged model is a no-op, so this watchdog forces a reload with a config
override that differs only in a ``neopp_reload`` parameter (ignored by the models).

A stub that is alive but does not answer is replaced, not resumed: a stub stopped by a signal
(SIGSTOP), or one Triton has answered "not healthy" for (``replace_unhealthy``, called by the HTTP
door when it sees that answer), is killed with SIGKILL so that it can never touch the server's
IPC again (a stopped stub that resumes after Triton gave up on it aborts tritonserver), and its
model is reloaded as for a dead stub.

The watchdog runs next to the server (it reads ``/proc``), talks to it over loopback, and needs
``--model-control-mode=explicit``. With the administrative APIs restricted (neopp.launcher.admin)
it sends the operator key (``$NEOPP_ADMIN_KEY`` or ``--admin-key-file``).
``neopp.launcher.tritonserver serve`` runs one by default; next
to a tritonserver started otherwise (NVIDIA's container), run it alone:

    python -m neopp.launcher.watchdog --url localhost:8001 [--server-pid PID] [--admin-key-file F]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..procs import all_pids, cmdline, is_stopped, ppid
from .admin import KEY_ENV, grpc_headers, http_headers
from .poller import Poller

STUB_NAME = "triton_python_backend_stub"
RELOAD_PARAMETER = "neopp_reload"


def server_stubs(server_pid: int) -> dict[str, int]:
    """Instance name -> pid of every Python stub the server started (its argv names the instance)."""
    stubs = {}
    for pid in all_pids():
        argv = cmdline(pid)
        if argv and argv[0].endswith(STUB_NAME) and ppid(pid) == server_pid and len(argv) >= 9:
            stubs[argv[8]] = pid  # argv: stub, model.py, shm name, sizes x2, parent pid, lib dir, ipc key, instance
    return stubs


def model_stub_pids(server_pid: int, model: str) -> list[int]:
    """Stub pids of one model's instances (``<model>_<group>_<index>``)."""
    return sorted(pid for name, pid in server_stubs(server_pid).items() if name.rsplit("_", 2)[0] == model)


def expected_instances(config: dict[str, Any]) -> list[str]:
    """Instance names Triton gives a model's instance groups (``<group name>_<i>``)."""
    names = []
    for index, group in enumerate(config.get("instance_group") or [{"count": 1}]):
        base = group.get("name") or f"{config['name']}_{index}"
        count = int(group.get("count", 1)) * max(1, len(group.get("gpus") or []))
        names += [f"{base}_{i}" for i in range(count)]
    return names


def key_headers(client: Any, key: str | None) -> dict[str, str] | None:
    """The operator-key header in the form ``client``'s protocol (gRPC or HTTP) expects."""
    if not key:
        return None
    return grpc_headers(key) if type(client).__module__.startswith("tritonclient.grpc") else http_headers(key)


def force_reload(client: Any, model: str, admin_key: str | None = None) -> float:
    """Reload ``model`` with its current config (plus a fresh marker); returns the seconds it took."""
    headers = key_headers(client, admin_key)
    config = client.get_model_config(model, as_json=True, headers=headers)["config"]
    config.setdefault("parameters", {})[RELOAD_PARAMETER] = {"string_value": f"{time.time():.6f}"}
    started = time.monotonic()
    client.load_model(model, config=json.dumps(config), headers=headers)
    return time.monotonic() - started


@dataclass
class Recovery:
    """One reload the watchdog did: which model, which instances were dead, how long it took."""

    model: str
    dead: list[str]
    reload_s: float
    error: str | None = None


@dataclass
class StubWatchdog:
    """Poll the server's stubs; reload a READY model whose instance has no live stub.

    A missing stub must stay missing for ``grace_s`` (a load in progress replaces stubs) before
    the model is reloaded. ``client`` is a ``tritonclient`` gRPC or HTTP client of the server;
    ``admin_key`` is sent when the server restricts its administrative APIs.
    """

    client: Any
    server_pid: int
    admin_key: str | None = None
    interval_s: float = 0.5
    grace_s: float = 1.0
    log: Callable[[str], None] = print
    recoveries: list[Recovery] = field(default_factory=list)
    _missing_since: dict[str, float] = field(default_factory=dict)
    _poller: Poller | None = None

    def replace_unhealthy(self, instance: str) -> None:
        """Kill the stub of an instance Triton called not healthy; the next poll reloads its model."""
        pid = server_stubs(self.server_pid).get(instance)
        if pid is not None:
            self._kill(instance, pid, "Triton reports it not healthy")

    def _kill(self, instance: str, pid: int, why: str) -> None:
        self.log(f"neopp watchdog: {instance}: {why}; killing its stub {pid} (SIGKILL)")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _kill_stopped(self, stubs: dict[str, int]) -> dict[str, int]:
        """Stubs stopped by a signal are killed; the live ones are returned."""
        for instance, pid in list(stubs.items()):
            if is_stopped(pid):
                self._kill(instance, pid, "its stub is stopped")
                del stubs[instance]
        return stubs

    def check_once(self) -> list[Recovery]:
        """One poll; returns the reloads it did."""
        done = []
        stubs = self._kill_stopped(server_stubs(self.server_pid))
        now = time.monotonic()
        headers = key_headers(self.client, self.admin_key)
        for entry in self.client.get_model_repository_index(as_json=True, headers=headers).get("models", []):
            model = entry["name"]
            if entry.get("state") != "READY":
                self._missing_since.pop(model, None)
                continue
            config = self.client.get_model_config(model, as_json=True, headers=headers)["config"]
            if config.get("backend") != "python":
                continue
            dead = [name for name in expected_instances(config) if name not in stubs]
            if not dead:
                self._missing_since.pop(model, None)
                continue
            first = self._missing_since.setdefault(model, now)
            if now - first < self.grace_s:
                continue
            self.log(f"neopp watchdog: {model}: no live stub for {dead}; reloading the model")
            try:
                recovery = Recovery(model, dead, force_reload(self.client, model, self.admin_key))
            except Exception as exc:  # noqa: BLE001 - reported, retried at the next poll
                recovery = Recovery(model, dead, 0.0, f"{type(exc).__name__}: {exc}")
            self.log(f"neopp watchdog: {model}: reload "
                     + (f"failed: {recovery.error}" if recovery.error
                        else f"done in {recovery.reload_s:.2f}s"))
            self._missing_since.pop(model, None)
            self.recoveries.append(recovery)
            done.append(recovery)
        return done

    def start(self) -> StubWatchdog:
        self._poller = Poller("neopp-stub-watchdog", self.interval_s, self.check_once,
                              lambda exc: self.log(f"neopp watchdog: poll failed: {type(exc).__name__}: {exc}"))
        self._poller.start()
        return self

    def stop(self) -> None:
        if self._poller is not None:
            self._poller.stop(timeout_s=30)
            self._poller = None

    def __enter__(self) -> StubWatchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_watchdog(grpc_url: str, server_pid: int, log: Callable[[str], None] = print,
                   admin_key: str | None = None) -> StubWatchdog:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    return StubWatchdog(client, server_pid, admin_key=admin_key, log=log).start()


def find_server_pid() -> int:
    """The one tritonserver process on this host (else ask for --server-pid)."""
    pids = [pid for pid in all_pids() if (cmdline(pid)[:1] or [""])[0].endswith("tritonserver")]
    if len(pids) != 1:
        raise SystemExit(f"found {len(pids)} tritonserver processes {pids}; pass --server-pid")
    return pids[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m neopp.launcher.watchdog", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="localhost:8001", help="the server's gRPC address")
    parser.add_argument("--server-pid", type=int, help="tritonserver's pid (default: the only one found)")
    parser.add_argument("--admin-key-file", help=f"operator key file (default ${KEY_ENV}; none: no key sent)")
    args = parser.parse_args(argv)
    key = Path(args.admin_key_file).read_text().strip() if args.admin_key_file else os.environ.get(KEY_ENV)
    watchdog = start_watchdog(args.url, args.server_pid or find_server_pid(),
                              log=lambda m: print(m, flush=True), admin_key=key)
    try:
        while watchdog._thread is not None and watchdog._thread.is_alive():
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        watchdog.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
