"""Bring a model back when its Python stub is dead, stopped or hung: Triton 2.51 itself does not.

Seen with the server this project runs (the nvidia-pytriton wheel's 2.51): after a model's
``triton_python_backend_stub`` dies, the model stays READY in the repository index, a request in
flight fails with INTERNAL "Stub process '<instance>' is not healthy." and so does every later
request (each after a 1 s health check); the stub is never restarted. A plain ``load_model`` of
an unchanged model is a no-op, so the watchdog forces a reload with a config override that
differs only in a ``neopp_reload`` parameter (ignored by the models).

The watchdog judges a stub only from what the launcher owns (``stub_facts``), never from an
error message, whose text a client can shape:

* **dead**: an instance of a READY model has no live stub for ``grace_s`` -> the model is
  reloaded, once per death; a reload that fails is retried with backoff, and after three
  failures, or one that does not finish within ``reload_timeout_s``, the supervisor restarts
  tritonserver (within its restart rate).
* **stopped** (SIGSTOP, a debugger, a frozen cgroup) for ``stopped_s``: after a second without
  an answer Triton gives up on it, and it aborts the server if it runs again; it is killed
  (``stub_kill``: never while it holds a lock it shares with the server) and its model reloaded.
* **engine down**: the stub that runs a model's engine says, in its heartbeat
  (``neopp.engine_beat``), that its engine's loop stopped -> the model (and a streamed twin on
  that engine) is not ready at once and the model is reloaded; the stub stays up meanwhile and
  answers every request with UNAVAILABLE.
* **hung**: requests waited for its model for ``hung_s`` while the whole server made no
  progress (no request answered, no denoising step run) and the model's own stubs and rank
  workers used almost no CPU. A busy stub uses CPU; a session stub waiting on a busy model sees
  that model step: neither is ever judged hung. Then it is killed and reloaded as above.

* **left over**: a reload replaces every instance of the model, but Triton 2.51 leaves the
  stubs of the old instances beside a dead one running for good. Stubs of the model that ran
  before a reload and still run ``leftover_s`` after it are ended (``stub_kill``).

A verdict is about one process (its pid and start time), so it never reaches the stub that
replaced it. What the watchdog knows goes to ``health`` (the door's readiness and refusals).

It runs next to the server (it reads ``/proc``), talks to it over loopback, and needs
``--model-control-mode=explicit``. With the administrative APIs restricted (neopp.launcher.admin)
it sends the operator key. ``neopp.launcher serve`` runs one; next to a tritonserver started
otherwise (NVIDIA's container), run it alone:

    python -m neopp.launcher.watchdog --url localhost:8001 --server-pid PID [--admin-key-file F]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine_beat import beat_path, read_beat
from ..procs import is_stopped, model_stubs, start_ticks
from .admin import KEY_ENV, grpc_headers, http_headers
from .health import ServerHealth
from .poller import Poller
from .stub_facts import Stub, alive, model_of, model_traffic, server_stubs
from .stub_kill import kill_stub

RELOAD_PARAMETER = "neopp_reload"
FAILED_RELOADS = 3  # in a row, before tritonserver is restarted
IDLE_CPU = 0.05  # CPU seconds per second a model's stubs use idle (health threads, rank heartbeats): < 0.03
TRAFFIC_EVERY_S = 2.0  # how often the hung rule reads the server's metrics
LEFTOVER_S = 15.0  # after a reload, how long the old instances' stubs may take to leave


def expected_instances(config: dict[str, Any]) -> list[str]:
    """Instance names Triton gives a model's instance groups (``<group name>_<i>``)."""
    names = []
    for index, group in enumerate(config.get("instance_group") or [{"count": 1}]):
        base = group.get("name") or f"{config['name']}_{index}"
        count = int(group.get("count", 1)) * max(1, len(group.get("gpus") or []))
        names += [f"{base}_{i}" for i in range(count)]
    return names


def engine_owner(config: dict[str, Any]) -> str:
    """The model whose stub runs ``config``'s engine: its ``engine_model`` parameter (a streamed
    twin hands its requests to its plain model), else the model itself."""
    value = ((config.get("parameters") or {}).get("engine_model") or {}).get("string_value")
    return value if isinstance(value, str) and value else str(config.get("name", ""))


def key_headers(client: Any, key: str | None) -> dict[str, str] | None:
    """The operator-key header in the form ``client``'s protocol (gRPC or HTTP) expects."""
    if not key:
        return None
    return grpc_headers(key) if type(client).__module__.startswith("tritonclient.grpc") else http_headers(key)


def force_reload(client: Any, model: str, admin_key: str | None = None, timeout_s: float | None = None,
                 config: dict[str, Any] | None = None) -> float:
    """Reload ``model`` with its current config, or ``config`` (plus a fresh marker); returns the
    seconds it took."""
    headers = key_headers(client, admin_key)
    if config is None:
        config = client.get_model_config(model, as_json=True, headers=headers)["config"]
    config = {**config, "parameters": {**config.get("parameters", {}),
                                       RELOAD_PARAMETER: {"string_value": f"{time.time():.6f}"}}}
    started = time.monotonic()
    extra = {} if timeout_s is None else {"client_timeout": timeout_s}
    client.load_model(model, config=json.dumps(config), headers=headers, **extra)
    return time.monotonic() - started


@dataclass
class Recovery:
    """One reload the watchdog did: which model, which instances were dead, how long it took."""

    model: str
    dead: list[str]
    reload_s: float
    error: str | None = None


class HangWatch:
    """Models whose requests waited ``hung_s`` while the whole server made no progress (no request
    answered, no denoising step run) and the model's own stubs used almost no CPU."""

    def __init__(self, hung_s: float) -> None:
        self.hung_s = hung_s
        self._since: dict[str, tuple[float, float, float]] = {}  # model -> (since, server progress, its CPU)

    def update(self, now: float, traffic: dict[str, tuple[float, float]], cpu_s: dict[str, float]) -> list[str]:
        """``traffic``: model -> (requests waiting, progress counter); ``cpu_s``: model -> its stubs' CPU time."""
        progress, hung = sum(p for _, p in traffic.values()), []
        for model in set(self._since) - {m for m, (pending, _) in traffic.items() if pending > 0}:
            del self._since[model]
        for model, (pending, _) in traffic.items():
            since = self._since.get(model)
            if pending <= 0:
                continue
            if since is None or since[1] != progress:
                self._since[model] = (now, progress, cpu_s.get(model, 0.0))
            elif now - since[0] >= self.hung_s:
                if cpu_s.get(model, 0.0) - since[2] < IDLE_CPU * (now - since[0]):
                    hung.append(model)
                self._since[model] = (now, progress, cpu_s.get(model, 0.0))
        return hung


@dataclass
class StubWatchdog:
    """Poll the server's stubs; replace the dead, stopped and hung ones (see the module's text).

    ``client`` is a ``tritonclient`` gRPC or HTTP client of the server; ``admin_key`` is sent
    when the server restricts its administrative APIs; ``metrics_url`` (the server's metrics)
    turns on the hung rule.
    """

    client: Any
    server_pid: int
    admin_key: str | None = None
    interval_s: float = 0.5
    grace_s: float = 1.0
    log: Callable[[str], None] = print
    health: ServerHealth = field(default_factory=ServerHealth)
    stopped_s: float = 1.0
    hung_s: float = 60.0
    reload_timeout_s: float = 300.0
    leftover_s: float = LEFTOVER_S
    metrics_url: str | None = None
    clock: Callable[[], float] = time.monotonic
    recoveries: list[Recovery] = field(default_factory=list)
    _missing_since: dict[str, float] = field(default_factory=dict)
    _stopped_since: dict[tuple[int, int], float] = field(default_factory=dict)
    _failures: dict[str, tuple[int, float]] = field(default_factory=dict)  # model -> (failed reloads, retry at)
    _configs: dict[str, dict[str, Any]] = field(default_factory=dict)  # the last config read of each model
    # (when, model, stubs as (pid, start)): stubs from before a reload that must be gone by then
    _leftovers: list[tuple[float, str, list[tuple[int, int]]]] = field(default_factory=list)
    _gone: bool = False
    _halted: bool = False
    _next_traffic: float = 0.0
    _poller: Poller | None = None

    def __post_init__(self) -> None:
        self._hangs = HangWatch(self.hung_s)

    def _server_alive(self) -> bool:
        if alive(self.server_pid):
            return True
        if not self._gone:
            self.log(f"neopp watchdog: tritonserver {self.server_pid} is gone; watching stops")
        self._gone = True
        return False

    def _restart(self, reason: str) -> None:
        """Hand over to the supervisor: it restarts tritonserver; nothing more to do here."""
        self.log(f"neopp watchdog: asking for a restart of tritonserver: {reason}")
        self.health.request_restart(reason)
        self.halt()

    def halt(self) -> None:
        """Act no more (the server is being stopped or restarted); ``stop`` ends the thread."""
        self._halted = True

    def _replace(self, stub: Stub, why: str) -> None:
        self.log(f"neopp watchdog: {stub.instance}: {why}; killing its stub {stub.pid} (SIGKILL)")
        self.health.model_broken(model_of(stub.instance), f"{stub.instance}: {why}")
        if not kill_stub(stub.pid, stub.started, self.log):
            self._restart(f"{stub.instance} could not be killed safely ({why})")

    def _replace_stopped(self, stubs: dict[str, Stub], now: float) -> None:
        seen = set()
        for stub in stubs.values():
            if not stub.stopped:
                continue
            seen.add(key := (stub.pid, stub.started))
            since = self._stopped_since.setdefault(key, now)
            self.health.model_broken(model_of(stub.instance), f"{stub.instance}: its stub is stopped")
            if now - since >= self.stopped_s and is_stopped(stub.pid):
                self._replace(stub, f"its stub is stopped ({now - since:.1f}s)")
        for key in set(self._stopped_since) - seen:
            del self._stopped_since[key]

    def _replace_hung(self, stubs: dict[str, Stub], now: float) -> None:
        if self.metrics_url is None or now < self._next_traffic:
            return
        self._next_traffic = now + TRAFFIC_EVERY_S
        cpu: dict[str, float] = {}
        for stub in stubs.values():
            cpu[model_of(stub.instance)] = cpu.get(model_of(stub.instance), 0.0) + stub.cpu_s
        for model in self._hangs.update(now, model_traffic(self.metrics_url), cpu):
            for stub in [s for s in stubs.values() if model_of(s.instance) == model and not s.stopped]:
                self._replace(stub, f"requests waited {self.hung_s:.0f}s while the server made no progress "
                                    "and this stub used no CPU: hung")

    def _end_leftovers(self, now: float) -> None:
        """End the stubs of replaced instances still running ``leftover_s`` after their reload."""
        due = [entry for entry in self._leftovers if entry[0] <= now]
        self._leftovers = [entry for entry in self._leftovers if entry[0] > now]
        for _, model, stubs in due:
            for pid, started in stubs:
                if not alive(pid) or start_ticks(pid) != started:
                    continue  # gone, as it should be (or its pid now another process's)
                self.log(f"neopp watchdog: {model}: stub {pid} of a replaced instance still runs "
                         f"{self.leftover_s:.0f}s after the reload; ending it")
                if not kill_stub(pid, started, self.log):
                    self._restart(f"a leftover stub of {model} could not be killed safely")

    def _python_models(self) -> list[tuple[str, dict[str, Any]]]:
        """(name, config) of every READY Python-backend model, and of every one whose reload by the
        watchdog failed (it may have left it unavailable: it is tried again)."""
        headers = key_headers(self.client, self.admin_key)
        out = []
        for entry in self.client.get_model_repository_index(as_json=True, headers=headers).get("models", []):
            name = entry["name"]
            if entry.get("state") != "READY":
                if name in self._failures and name in self._configs:
                    out.append((name, self._configs[name]))
                else:
                    self._missing_since.pop(name, None)
                continue
            config = self.client.get_model_config(name, as_json=True, headers=headers)["config"]
            if config.get("backend") == "python":
                self._configs[name] = config
                out.append((name, config))
        return out

    def check_once(self) -> list[Recovery]:
        """One poll; returns the reloads it did (after every model's health is marked: a reload
        takes seconds, and a twin whose engine is down must be unready meanwhile too)."""
        if self._halted or not self._server_alive():
            return []
        now = self.clock()
        stubs = server_stubs(self.server_pid)
        self._replace_stopped(stubs, now)
        self._replace_hung(stubs, now)
        self._end_leftovers(now)
        done = []
        for model, dead, why in self._verdicts(server_stubs(self.server_pid), now):
            if self._halted:
                break
            done.append(self._reload(model, dead, why))
        return done

    def _verdicts(self, stubs: dict[str, Stub], now: float) -> list[tuple[str, list[str], str]]:
        """Mark each Python model serving or broken; (model, dead instances, why) of those to reload now."""
        stopped = {model_of(name) for name, stub in stubs.items() if stub.stopped}
        reloads: list[tuple[str, list[str], str]] = []
        for model, config in self._python_models():
            due = now >= self._failures.get(model, (0, 0.0))[1]
            dead = [name for name in expected_instances(config) if name not in stubs]
            if not dead:
                self._missing_since.pop(model, None)
                owner = engine_owner(config)
                down = self._engine_down(model, owner)
                if down is not None and owner == model and due:
                    reloads.append((model, [], f"its engine is down ({down})"))
                elif down is None and model not in self._failures and model not in stopped:
                    self.health.model_serving(model)
                continue
            self.health.model_broken(model, f"no live stub for {dead}")
            if now - self._missing_since.setdefault(model, now) >= self.grace_s and due:
                reloads.append((model, dead, ""))
        return reloads

    def _engine_down(self, model: str, owner: str) -> str | None:
        """Why the engine ``model`` runs on (``owner``'s) says it can serve no more (its heartbeat),
        else None; marks ``model`` broken (a twin too: only the owner is reloaded)."""
        beat = read_beat(beat_path(owner, self.server_pid))
        if beat is None or beat.alive:
            return None
        self.health.model_broken(model, f"its engine is down ({beat.why})")
        return beat.why

    def _reload(self, model: str, dead: list[str], why: str = "") -> Recovery:
        why = why or f"no live stub for {dead}"
        self.log(f"neopp watchdog: {model}: {why}; reloading the model")
        self.health.model_broken(model, f"reloading ({why})")
        old = [(pid, start) for pid in model_stubs(self.server_pid, model) if (start := start_ticks(pid))]
        started = self.clock()
        try:
            recovery = Recovery(model, dead, force_reload(self.client, model, self.admin_key, self.reload_timeout_s,
                                                          self._configs.get(model)))
        except Exception as exc:  # noqa: BLE001 - reported; retried, then the server is restarted
            recovery = Recovery(model, dead, self.clock() - started, f"{type(exc).__name__}: {exc}")
        self._missing_since.pop(model, None)
        self.recoveries.append(recovery)
        if recovery.error is None:  # Triton has loaded every instance anew
            self._failures.pop(model, None)
            self.health.model_serving(model)
            self._leftovers.append((self.clock() + self.leftover_s, model, old))
            self.log(f"neopp watchdog: {model}: reload done in {recovery.reload_s:.2f}s")
            return recovery
        failed = self._failures.get(model, (0, 0.0))[0] + 1
        self._failures[model] = (failed, self.clock() + min(30.0, 2.0 ** failed))
        self.log(f"neopp watchdog: {model}: reload failed ({failed} in a row): {recovery.error}")
        if recovery.reload_s >= self.reload_timeout_s:
            self._restart(f"the reload of {model} did not finish within {self.reload_timeout_s:.0f}s")
        elif failed >= FAILED_RELOADS:
            self._restart(f"{failed} reloads of {model} failed in a row")
        return recovery

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
                   admin_key: str | None = None, **options: Any) -> StubWatchdog:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    return StubWatchdog(client, server_pid, admin_key=admin_key, log=log, **options).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m neopp.launcher.watchdog", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="localhost:8001", help="the server's gRPC address")
    parser.add_argument("--server-pid", type=int, required=True, help="tritonserver's pid")
    parser.add_argument("--metrics-url", help="the server's metrics (http://host:8002/metrics): the hung rule")
    parser.add_argument("--admin-key-file", help=f"operator key file (default ${KEY_ENV}; none: no key sent)")
    args = parser.parse_args(argv)
    key = Path(args.admin_key_file).read_text().strip() if args.admin_key_file else os.environ.get(KEY_ENV)
    watchdog = start_watchdog(args.url, args.server_pid, log=lambda m: print(m, flush=True), admin_key=key,
                              metrics_url=args.metrics_url)
    try:
        while watchdog.health.take_restart() is None and start_ticks(args.server_pid) is not None:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        watchdog.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
