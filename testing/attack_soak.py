"""``make soak-attack``: legitimate traffic at twice what the server completes, every core busy,
first alone, then under attack; what the legitimate clients got, and what the attacks cost them.

    python -m testing.attack_soak --seconds 120 [--json build/attack_soak.json]   (its launcher's log: .launcher.log)

One launcher as `make serve` runs it (the door, the watchdog, restarts) on the demo model, with
``neopp_dense``, its streamed twin, ``neopp_session`` (held to a small table, so that a flood fills it
in seconds), ``neopp_prompt_encoder`` and ``neopp_t2i`` (the ``/v1`` route). A CPU burner per core
runs from start to end (started and stopped by pid). Then:

1. references: every request's bytes, one at a time;
2. calibration: the rate at which 4 clients sending back to back get correct answers;
3. baseline: jobs at twice that rate for ``--seconds`` (plain gRPC, streams, ``/v1``, 2-turn sessions);
4. attack: the same jobs for ``--seconds`` while 256 idle connections, 3 trickled uploads, 3 large-JSON
   posters, planted "not healthy" texts, a session flood and another client's 40 parallel ``/v1``
   requests of 4 images run, and ``neopp_dense``'s stub is SIGKILLed a third of the way in.

Printed: each phase's outcomes by label and kind, the latency of correct answers (p50/p99, attack
against baseline), the time from the SIGKILL to a correct ``neopp_dense`` answer, which stubs each
model lost during the attack (read from the server's processes: only the one SIGKILLed should go)
and what the launcher's log says its watchdog did, the door's ``/v2/health/live`` latency, resident
memory before and after, and each goal with PASS or FAIL. Exit status 0 only when every goal holds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from neopp.model.kv_cache import load_kv_file
from neopp.ports import LOOPBACK
from neopp.procs import descendants, model_stubs, rss_bytes
from testing import REPO
from testing.attacks import (
    ClientFlood,
    GrpcAbuse,
    IdleConnections,
    LargeJson,
    PlantedUnhealthy,
    SessionFlood,
    TrickledUploads,
)
from testing.faults import signal_own, stub_pid
from testing.launched import Launched, launch
from testing.loadgen import grpc_inputs, valid_inputs
from testing.mixed_traffic import KINDS, OpenLoop, Outcome, Workload, closed_loop_rate
from testing.probe_process import FloorServer, ProcessProbe

KILLED_MODEL = "neopp_dense"  # the model whose stub the drill SIGKILLs
MODELS = ("neopp_dense", "neopp_dense_stream", "neopp_session", "neopp_prompt_encoder", "neopp_t2i")
DEMO = REPO / "demo" / "checkpoints" / "dense"
PROMPT = "a red circle on the left on a blue background"
OFFSETS = (11, 1)  # the demo sample prefixes' index offsets (README)
SESSIONS = 32  # neopp_session's table during the soak: above the legitimate sessions in flight, a flood fills it
ADMIN = "triton-grpc-protocol-neopp-admin-key"
PLANTED = [("neopp_dense", "neopp_dense_0_0"), ("neopp_dense_stream", "neopp_dense_stream_0_0"),
           ("neopp_t2i", "neopp_t2i_0_0"), ("neopp_session", "neopp_session_0_0"),
           ("neopp_prompt_encoder", "neopp_prompt_encoder_0_0")]
GOOD = ("ok", "refused")  # what a legitimate request may get


class Burners:
    """One busy-looping process per core, started and stopped by pid."""

    def __init__(self, count: int | None = None) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(count or os.cpu_count() or 1)]

    def stop(self) -> None:
        for proc in self.procs:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


def summary(outcomes: list[Outcome], not_sent: int, seconds: float) -> dict[str, Any]:
    ok = [o.seconds for o in outcomes if o.label == "ok"]
    return {"requests": len(outcomes), "not_sent": not_sent, "per_s": round(len(outcomes) / seconds, 2),
            "labels": dict(Counter(o.label for o in outcomes)),
            "by_kind": {k: dict(Counter(o.label for o in outcomes if o.kind == k)) for k in KINDS},
            "details": dict(Counter(o.detail for o in outcomes if o.detail).most_common(8)),
            "ok_p50_ms": _ms(ok, 50), "ok_p99_ms": _ms(ok, 99),
            "ok_p50_ms_by_kind": {k: _ms([o.seconds for o in outcomes if o.kind == k and o.label == "ok"], 50)
                                  for k in KINDS}}


def server_rss(launcher: Launched) -> float:
    pid = launcher.proc.pid
    return round(rss_bytes([pid, *descendants(pid)]) / 2**20, 1)


class StubKill:
    """SIGKILL ``neopp_dense``'s stub, then a correct answer from it as soon as there is one."""

    def __init__(self, launcher: Launched, workload: Workload) -> None:
        self.launcher, self.workload = launcher, workload
        self.result: dict[str, Any] = {}
        self.thread: threading.Thread | None = None

    def fire(self) -> None:
        self.thread = threading.Thread(target=self._run, name="stub-kill", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        server = self.launcher.server_pid
        pid = stub_pid(server, KILLED_MODEL)
        log_at = len(self.launcher.text())
        killed = time.monotonic()
        signal_own(server, pid)
        expected = self.workload.expected["grpc", self.workload.seeds[0]][0]
        client, attempts, errors = grpcclient.InferenceServerClient(self.workload.grpc_url), 0, Counter()
        inputs = grpc_inputs(valid_inputs(self.workload.cond, self.workload.uncond, self.workload.offsets,
                                          self.workload.seeds[0], size=(self.workload.size,) * 2,
                                          steps=self.workload.steps))
        while time.monotonic() - killed < 180:
            attempts += 1
            try:
                got = client.infer("neopp_dense", inputs, client_timeout=60).as_numpy("IMAGE")[0]
                if bytes(got) == expected:
                    self.result["serving_again_s"] = round(time.monotonic() - killed, 2)
                    break
            except Exception as exc:  # noqa: BLE001 - counted until it serves again
                errors[f"{type(exc).__name__}: {str(exc)[:80]}"] += 1
            time.sleep(0.2)
        client.close()
        self.result.update(killed_pid=pid, attempts=attempts, errors=dict(errors.most_common(4)), log_from=log_at)


class StubCensus:
    """The stub pids of every model, read from the server's own processes every ``every_s``: which
    stubs each model had during a phase and which of them are gone at its end says how often it
    lost one, whatever the logs say."""

    def __init__(self, launcher: Launched, models: Sequence[str], every_s: float = 0.5) -> None:
        self.launcher, self.models, self.every_s = launcher, models, every_s
        self.seen: dict[str, set[int]] = {m: set() for m in models}
        self.now: dict[str, set[int]] = {m: set() for m in models}
        self.first: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stub-census", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            servers = self.launcher.server_pids()
            for model in self.models:
                self.now[model] = {pid for server in servers for pid in model_stubs(server, model)}
                self.seen[model] |= self.now[model]
                self.first.setdefault(model, len(self.now[model]))
            if self._stop.wait(self.every_s):
                return

    def settle(self, timeout_s: float) -> float | None:
        """Seconds until every model has as many stubs as at the start (a reload's old instances
        gone: Triton unloads them once their last requests end), or None after ``timeout_s``."""
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            if self.first and all(len(self.now[m]) == self.first.get(m) for m in self.models):
                return round(time.monotonic() - began, 1)
            time.sleep(self.every_s)
        return None

    def stop(self) -> dict[str, dict[str, int]]:
        """Per model: stubs at the start (one per instance), processes seen, those gone by the end (lost),
        those alive at the end."""
        self._stop.set()
        self._thread.join(timeout=30)
        return {m: {"at_start": self.first.get(m, 0), "seen": len(self.seen[m]),
                    "lost": len(self.seen[m] - self.now[m]), "alive": len(self.now[m])} for m in self.models}


def watchdog_actions(text: str) -> dict[str, Any]:
    """What the launcher's log says its watchdog and supervisor did (counts, then the lines)."""
    return {"stubs killed": len(re.findall(r"killing its stub", text)),
            "reloads": len(re.findall(r"neopp watchdog: \S+: no live stub", text)),
            "server restarts": len(re.findall(r"tritonserver exited", text)),
            "lines": re.findall(r"^.*(?:neopp watchdog|tritonserver exited).*$", text, re.MULTILINE)[:12]}


def start_attacks(launcher: Launched, workload: Workload) -> list[Any]:
    def open_session(sid: int) -> None:
        client = workload.client()
        client.infer("neopp_session", grpc_inputs(valid_inputs(workload.cond, workload.uncond, workload.offsets, 1,
                                                               size=(32, 32), steps=1)),
                     sequence_id=sid, sequence_start=True, client_timeout=60)

    port = launcher.http_port
    return [IdleConnections(port).start(), TrickledUploads(port).start(), LargeJson(port).start(),
            PlantedUnhealthy(port, PLANTED).start(), SessionFlood(open_session).start(),
            ClientFlood(port, PROMPT).start(), GrpcAbuse(f"{LOOPBACK}:{launcher.grpc_port}").start()]


def small_session_table(launcher: Launched, key: str) -> None:
    client = grpcclient.InferenceServerClient(f"{LOOPBACK}:{launcher.grpc_port}")
    config = client.get_model_config("neopp_session", as_json=True, headers={ADMIN: key})["config"]
    config["parameters"]["max_sessions"] = {"string_value": str(SESSIONS)}
    config["sequence_batching"]["oldest"]["max_candidate_sequences"] = str(2 * SESSIONS)
    client.load_model("neopp_session", config=json.dumps(config), headers={ADMIN: key})
    client.close()


def phase(workload: Workload, rate: float, seconds: float, port: int, on_tick: Any = None) -> dict[str, Any]:
    floor = FloorServer()
    probe = ProcessProbe(port, interval_s=0.25).start()  # GET /v2/health/live, fresh connections, own process
    floor_probe = ProcessProbe(floor.port, interval_s=0.25).start()  # the same, of a one-thread server beside it
    load = OpenLoop(workload, rate)
    began = time.monotonic()
    try:
        load.run(seconds, on_tick)
    finally:
        probe.stop()
        floor_probe.stop()
        floor.stop()
    result = summary(load.outcomes, load.not_sent, time.monotonic() - began)
    result["health_live"], result["health_floor"] = probed(probe), probed(floor_probe)
    return result


def probed(probe: ProcessProbe) -> dict[str, Any]:
    return {"probes": len(probe.latencies), "answers": {str(k): v for k, v in probe.statuses.items()},
            "p50_ms": _ms(probe.latencies, 50), "p99_ms": _ms(probe.latencies, 99)}


def one_replacement(killed: bool, stubs: dict[str, int]) -> bool:
    """Every instance alive at the end; the killed model's reload replaced its stubs once (each
    instance's at most once), every other model lost none."""
    return (stubs["at_start"] > 0 and stubs["alive"] == stubs["at_start"]
            and (0 < stubs["lost"] <= stubs["at_start"] if killed else stubs["lost"] == 0))


def goals(report: dict[str, Any]) -> list[tuple[str, bool]]:
    base, attack, kill, stubs = report["baseline"], report["attack"], report["stub_kill"], report["stubs_during_attack"]
    labels = attack["labels"]
    ratio = [attack[k] / base[k] for k in ("ok_p50_ms", "ok_p99_ms") if attack[k] and base[k]]
    return [("legitimate requests under attack: every one answered correctly or refused with a retry hint",
             set(labels) <= set(GOOD) and labels.get("ok", 0) > 0),
            ("their p50 and p99 within 2x of the baseline's", len(ratio) == 2 and max(ratio) <= 2.0),
            ("a SIGKILLed stub serves again within 30 s, one kill and no loop (one replacement, no other stub lost)",
             (kill.get("serving_again_s") or 1e9) <= 30
             and all(one_replacement(m == KILLED_MODEL, n) for m, n in stubs.items())
             and kill["actions"]["stubs killed"] == 0 and kill["actions"]["reloads"] <= 1),
            ("every malformed gRPC call of the attack refused before its deadline (none left waiting, none served)",
             not any(k.endswith(("deadline", "OK")) for k in report["attacks_sent"].get("grpc-abuse", {}))),
            ("the door's /v2/health/live p99 under attack below 100 ms",
             (attack["health_live"]["p99_ms"] or 1e9) < 100 and set(attack["health_live"]["answers"]) == {"200"}),
            ("the same p99 within 1.5x of a one-thread server's probed beside it (this machine's floor then)",
             (attack["health_live"]["p99_ms"] or 1e9) <= 1.5 * (attack["health_floor"]["p99_ms"] or 0))]


def run(ns: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    key_file = tmp / "admin.key"
    env = {"NEOPP_CHECKPOINT": str(DEMO), "NEOPP_CHECKPOINT_NEOPP_PROMPT_ENCODER": str(DEMO),
           "NEOPP_ALLOW_UNTRAINED_SIZES": "true"}  # small sizes keep the soak quick; the demo draws 128-320
    launcher = launch(tmp / "launcher.log", env, MODELS, max_restarts=5,
                      launcher_args=["--admin-key-file", str(key_file), "--server-nice", str(ns.server_nice)])
    burners = Burners() if ns.burn else None
    report: dict[str, Any] = {"cores": os.cpu_count(), "burners": len(burners.procs) if burners else 0,
                              "server_nice": ns.server_nice}
    try:
        launcher.wait_for("NeoPP Triton server ready", timeout=900)
        small_session_table(launcher, key_file.read_text().strip())
        kv = DEMO / "sample_kv"
        workload = Workload(f"{LOOPBACK}:{launcher.grpc_port}", launcher.http_port,
                            load_kv_file(kv / "cond_kv.pt").float().numpy(),
                            load_kv_file(kv / "uncond_kv.pt").float().numpy(), OFFSETS, PROMPT)
        workload.references()
        capacity, labels = closed_loop_rate(workload, clients=4, seconds=ns.calibrate)
        rate = max(2 * capacity, 0.1)
        report.update(capacity_jobs_per_s=round(capacity, 2), calibration=dict(labels),
                      offered_jobs_per_s=round(rate, 2), seconds_per_phase=ns.seconds)
        print(f"completes {capacity:.2f} jobs/s ({dict(labels)}); offering {rate:.2f} jobs/s per phase", flush=True)
        report["rss_mib_before"] = server_rss(launcher)
        report["baseline"] = phase(workload, rate, ns.seconds, launcher.http_port)
        print(f"baseline: {json.dumps(report['baseline'])}", flush=True)
        kill = StubKill(launcher, workload)
        attacks = start_attacks(launcher, workload)
        fired = threading.Event()

        def tick(elapsed: float) -> None:
            if elapsed >= ns.seconds / 3 and not fired.is_set():
                fired.set()
                kill.fire()

        census = StubCensus(launcher, MODELS)
        report["attack"] = phase(workload, rate, ns.seconds, launcher.http_port, tick)
        report["attacks_sent"] = {a.name: a.stop() for a in attacks}
        if kill.thread is not None:
            kill.thread.join(timeout=200)
        time.sleep(2.0)  # what the last answers set off
        report["stubs_settled_after_s"] = census.settle(timeout_s=300)
        report["stubs_during_attack"] = census.stop()
        kill.result["actions"] = watchdog_actions(launcher.text()[kill.result.get("log_from", 0):])
        report["stub_kill"] = kill.result
        report["rss_mib_after"] = server_rss(launcher)
    finally:
        if burners is not None:
            burners.stop()
        report["launcher_exit"] = launcher.stop()
        report["left_behind"] = {str(k): v for k, v in launcher.leftovers().items()}
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testing.attack_soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120.0, help="length of the baseline and the attack phase")
    parser.add_argument("--calibrate", type=float, default=30.0, help="seconds of the closed-loop calibration")
    parser.add_argument("--no-burn", dest="burn", action="store_false", help="leave the cores to the server")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--server-nice", type=int, default=0, help="the launcher's --server-nice (default 0)")
    ns = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="neopp-attack-soak-") as tmp:
        try:
            report = run(ns, Path(tmp))
        finally:
            if ns.json:  # the launcher's log next to the report
                ns.json.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(Path(tmp) / "launcher.log", ns.json.with_suffix(".launcher.log"))
    for part in ("attack", "attacks_sent", "stub_kill", "stubs_settled_after_s", "stubs_during_attack"):
        print(f"{part}: {json.dumps(report.get(part))}", flush=True)
    print(f"memory (launcher, tritonserver and stubs): {report.get('rss_mib_before')} MiB before, "
          f"{report.get('rss_mib_after')} MiB after", flush=True)
    checks = goals(report) if "stub_kill" in report else []
    report["goals"] = {name: held for name, held in checks}
    for name, held in checks:
        print(f"{'PASS' if held else 'FAIL'}  {name}", flush=True)
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if checks and all(held for _, held in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
