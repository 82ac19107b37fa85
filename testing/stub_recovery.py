"""A model's stub SIGKILLed while clients keep calling, through the real launcher: how long until
it serves again, what clients saw meanwhile, how many reloads and kills the launcher did.

    python -m testing.stub_recovery [--kills 3] [--interval 2] [--checkpoint demo/checkpoints/dense]

starts ``python -m neopp.launcher serve`` on free loopback ports with ``neopp_prompt_encoder``,
``neopp_t2i`` and ``neopp_dense`` (the demo checkpoint, whose prompt encoder ``/v1`` needs), sends
``POST /v1/images/generations`` every ``--interval`` seconds (one client, a fixed seed) and
kills ``neopp_dense``'s stub ``--kills`` times, each once the one before is over. Each kill is
one line: seconds from the kill to the first right image, the answers in between by status,
the launcher's reloads and stub kills. The e2e suite runs the same measurement on ``/v2`` infer
(tests/e2e/test_front_door_e2e.py).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from testing import REPO
from testing.faults import kill_own_stub, stub_pid, wait_for
from testing.launched import Launched, launch

Answer = tuple[float, int, str | None, bool]  # (when, HTTP status, Retry-After, the right image)


@dataclass
class DeathUnderTraffic:
    """One stub death: everything after the kill, times in seconds after it."""

    recovery_s: float
    answers: list[Answer]
    readiness: list[tuple[float, int, int]]  # (when, /v2/health/ready, the model's ready route)
    log: str  # the launcher's output since the kill

    def reloads(self, model: str) -> int:
        return self.log.count(f"neopp watchdog: {model}: no live stub")

    def summary(self, model: str) -> str:
        statuses = Counter(status for _, status, _, _ in self.answers)
        took = re.findall(rf"neopp watchdog: {model}: reload done in ([\d.]+)s", self.log)
        warm = re.findall(rf'"{model}: loaded .* warm-up ([\d.]+)s"', self.log)
        return (f"serving again after {self.recovery_s:.1f}s (the reload {', '.join(took) or '?'}s, of which "
                f"warm-up {', '.join(warm) or '?'}s); answers meanwhile {dict(sorted(statuses.items()))}; "
                f"reloads {self.reloads(model)}, stub kills by the launcher {self.log.count('killing its stub')}, "
                f"tritonserver restarts {self.log.count('restarting tritonserver')}")


def http_status(port: int, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None, timeout: float = 600.0) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh loopback connection: (status, lower-case headers, body); 0 if refused."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    except OSError:
        return 0, {}, b""
    finally:
        conn.close()


def stub_death_under_traffic(launched: Launched, model: str, send: Callable[[], tuple[int, dict[str, str], bool]],
                             pace_s: float = 0.1, timeout_s: float = 120.0,
                             kill: Callable[[int, int], None] = kill_own_stub) -> DeathUnderTraffic:
    """Traffic from one client (``send``: status, headers, right image) and a readiness probe; once two
    answers are right, ``kill(server pid, stub pid)`` (by default as the launcher kills: never holding a
    lock); return once the model serves again and the replica is ready."""
    answers: list[Answer] = []
    readiness: list[tuple[float, int, int]] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            status, headers, right = send()
            answers.append((time.monotonic(), status, headers.get("retry-after"), right))
            stop.wait(pace_s)

    def probe() -> None:
        while not stop.is_set():
            codes = [http_status(launched.http_port, "GET", path, timeout=10)[0]
                     for path in ("/v2/health/ready", f"/v2/models/{model}/ready")]
            readiness.append((time.monotonic(), *codes))
            stop.wait(0.1)

    workers = [threading.Thread(target=traffic, daemon=True), threading.Thread(target=probe, daemon=True)]
    for w in workers:
        w.start()
    try:
        if not wait_for(lambda: sum(a[3] for a in answers) >= 2, timeout_s, poll=0.05):
            raise RuntimeError(f"no right answer before the kill: {answers[-3:]}")
        before = len(launched.text())
        kill(launched.server_pid, stub_pid(launched.server_pid, model))  # this generation's engine stub
        killed_at = time.monotonic()
        if not wait_for(lambda: any(t > killed_at and right for t, _, _, right in answers), timeout_s, poll=0.05):
            raise RuntimeError(f"{model} not serving {timeout_s:.0f}s after its stub was killed")
        back = min(t for t, _, _, right in answers if t > killed_at and right)
        wait_for(lambda: sum(t > back for t, *_ in answers) >= 3 and readiness[-1][1:] == (200, 200), 30, poll=0.1)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=timeout_s)
    return DeathUnderTraffic(back - killed_at, [(t - killed_at, *rest) for t, *rest in answers if t > killed_at],
                             [(t - killed_at, *rest) for t, *rest in readiness if t > killed_at],
                             launched.text()[before:])


def _images_client(port: int, seed: int) -> Callable[[], tuple[int, dict[str, str], bool]]:
    body = json.dumps({"prompt": "a red circle on the left on a blue background", "size": "256x256",
                       "seed": seed, "num_inference_steps": 8}).encode()
    expected: list[bytes] = []

    def send() -> tuple[int, dict[str, str], bool]:
        status, headers, answer = http_status(port, "POST", "/v1/images/generations", body,
                                              {"Content-Type": "application/json"})
        image = base64.b64decode(json.loads(answer)["data"][0]["b64_json"]) if status == 200 else None
        if status not in (200, 503):
            print(f"    answer {status}: {answer[:300]!r}", flush=True)
        if image is not None and not expected:
            expected.append(image)
        return status, headers, image is not None and image == expected[0]
    return send


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testing.stub_recovery", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between two requests of the client")
    parser.add_argument("--checkpoint", default=str(REPO / "demo" / "checkpoints" / "dense"))
    ns = parser.parse_args(argv)
    model, ok = "neopp_dense", True
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = str(Path(ns.checkpoint).resolve())
        env = {"NEOPP_CHECKPOINT": checkpoint, "NEOPP_CHECKPOINT_NEOPP_PROMPT_ENCODER": checkpoint}
        launched = launch(Path(tmp) / "serve.log", env,
                          ("neopp_prompt_encoder", "neopp_t2i", model), max_restarts=2)
        try:
            launched.wait_for("NeoPP Triton server ready", timeout=900)
            send = _images_client(launched.http_port, seed=7)
            for kill in range(1, ns.kills + 1):
                death = stub_death_under_traffic(launched, model, send, pace_s=ns.interval, timeout_s=300)
                bad = [a for a in death.answers if not (a[3] or (a[1] == 503 and a[2]))]
                ok &= not bad and death.reloads(model) == 1
                print(f"kill {kill}: {death.summary(model)}" + (f"; other answers {bad[:5]}" if bad else ""),
                      flush=True)
        finally:
            launched.stop()
    print("STUB RECOVERY " + ("PASSED" if ok else "FAILED"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
