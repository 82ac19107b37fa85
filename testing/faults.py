"""Fault scenarios against a real server, measured: what the client sees, how long recovery takes.

Used by the e2e tests (which assert on the outcome) and by ``testing.soak`` (which prints
it). Every wait is bounded. Processes are looked up from the server under test (its pid and
process group, ``neopp.procs``) and re-checked right before they are signalled, so
another server on the same host is never selected or touched.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from neopp.launcher.stub_kill import kill_stub as kill_safely
from neopp.procs import cmdline, model_stubs, server_processes, spawned_children, start_ticks, stub_instance
from testing.fuzz import Inputs
from testing.loadgen import image_bytes, infer, with_token

STEPS_METRIC = "neopp_denoising_steps_total"


def _series(metrics_url: str) -> list[tuple[str, dict[str, str], float]]:
    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    out = []
    for line in text.splitlines():
        m = re.match(r"^(\w+)\{(.*)\} (\S+)$", line)
        if m:
            out.append((m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))), float(m.group(3))))
    return out


def metric(metrics_url: str, name: str, **labels: str) -> float:
    """Current value of one series (0 when absent)."""
    return next((v for n, got, v in _series(metrics_url) if n == name and got == labels), 0.0)


def metric_sum(metrics_url: str, name: str, **labels: str) -> float:
    """Sum over every series of ``name`` carrying ``labels`` (e.g. failures of all reasons)."""
    return sum(v for n, got, v in _series(metrics_url) if n == name and labels.items() <= got.items())


def signal_own(server_pid: int, pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal ``pid`` only if it is still one of this server's processes (a pid can be reused)."""
    if pid not in server_processes(server_pid):
        raise RuntimeError(f"pid {pid} is not a process of tritonserver {server_pid}; not signalled")
    os.kill(pid, sig)


def kill_own_stub(server_pid: int, pid: int) -> None:
    """SIGKILL a Python stub of this server as the launcher does: never while it holds a lock it
    shares with tritonserver (that aborts the server, neopp.launcher.stub_kill)."""
    started = start_ticks(pid)
    if pid not in server_processes(server_pid) or started is None:
        raise RuntimeError(f"pid {pid} is not a process of tritonserver {server_pid}; not killed")
    if not kill_safely(pid, started, print, bound_s=60.0):
        raise RuntimeError(f"stub {pid} held a lock it shares with tritonserver for 60 s; not killed")


def stub_pid(server_pid: int, model: str, timeout: float = 60.0) -> int:
    """The stub of ``model``'s first instance under this server: the one that loads the mode's
    engine (and its rank processes); the other instances hand their requests to it.

    Just after a reload the old stub may still be exiting next to the new one: wait (bounded)
    until one is left, so the stub picked is the one serving.
    """
    pids: list[int] = []

    def one() -> bool:
        nonlocal pids
        pids = [p for p in model_stubs(server_pid, model) if stub_instance(cmdline(p)) == f"{model}_0_0"]
        return len(pids) == 1

    if not wait_for(one, timeout, poll=0.1):
        raise RuntimeError(f"expected one first-instance stub for {model} under server {server_pid}, found {pids}")
    return pids[0]


def rank_pids(server_pid: int, model: str) -> list[int]:
    """Rank worker pids of a parallel model: spawned children of its stub under this server."""
    return spawned_children(stub_pid(server_pid, model), server_pid)


def wait_for(condition: Callable[[], bool], timeout: float, poll: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll)
    return condition()


@dataclass
class StubKill:
    """Outcome of killing a model's stub: the in-flight answer, what retries saw, recovery time."""

    model: str
    killed_pid: int
    in_flight: str | None = None  # "ok" or the error of the request running when the stub died
    seen_errors: list[str] = field(default_factory=list)  # distinct errors of later requests, in order
    attempts: int = 0
    recovery_s: float | None = None  # kill -> first request answered with the expected bytes
    same_bytes: bool = False


def _mid_step(metrics_url: str, model: str, before: float, timeout: float) -> None:
    """Return in the middle of a step's compute (time one step between two step ends, then wait
    half a step after the second): the request is surely running when its stub is killed."""
    def at_least(n: float) -> float:
        got = wait_for(lambda: metric(metrics_url, STEPS_METRIC, model=model) >= n, timeout, poll=0.005)
        if not got:
            raise RuntimeError(f"{model}: the long request ran no step {n - before:.0f} within {timeout:.0f}s")
        return time.monotonic()

    first = at_least(before + 1)
    second = at_least(before + 2)
    time.sleep(max(0.0, (second - first) / 2))


def kill_stub(client: Any, server_pid: int, model: str, inputs: Inputs, expected: bytes,
              during: Inputs | None = None, metrics_url: str | None = None,
              timeout: float = 120.0) -> StubKill:
    """SIGKILL the model's stub (while ``during`` runs, if given), then retry ``inputs`` until answered.

    Recovery needs something that reloads the model (a running ``StubWatchdog``).
    """
    outcome = StubKill(model, stub_pid(server_pid, model))
    worker = None
    if during is not None:
        def long_request() -> None:
            try:
                infer(client, model, during, timeout=timeout)
                outcome.in_flight = "ok"
            except Exception as exc:  # noqa: BLE001 - the answer is what we report
                outcome.in_flight = f"{type(exc).__name__}: {exc}"

        before = metric(metrics_url, STEPS_METRIC, model=model) if metrics_url else 0.0
        worker = threading.Thread(target=long_request)
        worker.start()
        if metrics_url:  # the generation is really running: a step is done
            _mid_step(metrics_url, model, before, timeout)
    killed_at = time.monotonic()
    kill_own_stub(server_pid, outcome.killed_pid)
    if worker is not None:
        worker.join(timeout)
    deadline = killed_at + timeout
    while time.monotonic() < deadline:
        outcome.attempts += 1
        try:
            got = image_bytes(infer(client, model, inputs, timeout=timeout))
        except Exception as exc:  # noqa: BLE001 - recorded; retried until the deadline
            message = f"{type(exc).__name__}: {exc}"
            if message not in outcome.seen_errors:
                outcome.seen_errors.append(message)
            time.sleep(0.2)
            continue
        outcome.recovery_s = time.monotonic() - killed_at
        outcome.same_bytes = got == expected
        break
    return outcome


@dataclass
class SessionRestart:
    """A session's later turn after its session model was restarted."""

    how: str
    first_turn_ok: bool
    continued_error: str | None  # None would mean it was continued (must not happen)
    restart_ok: bool = False  # a new session with the same id works


def restart_session_model(client: Any, server_pid: int, inputs: Inputs, sequence_id: int,
                          restart: Callable[[], None], how: str, model: str = "neopp_session",
                          timeout: float = 120.0) -> SessionRestart:
    """Start a session, ``restart`` the session model, then send the next turn of that session."""
    first = infer(client, model, inputs, timeout=timeout, sequence_id=sequence_id, sequence_start=True)
    restart()
    later = with_token({k: v for k, v in inputs.items() if k != "SEED"}, first)
    outcome = SessionRestart(how, bool(image_bytes(first)), None)
    try:
        infer(client, model, later, timeout=timeout, sequence_id=sequence_id)
    except Exception as exc:  # noqa: BLE001 - the refusal is the expected outcome
        outcome.continued_error = f"{type(exc).__name__}: {exc}"
    again = infer(client, model, inputs, timeout=timeout, sequence_id=sequence_id, sequence_start=True,
                  sequence_end=True)
    outcome.restart_ok = bool(image_bytes(again))
    return outcome


@dataclass
class Shutdown:
    """SIGTERM with requests in flight: each one's answer, how long the stop took, what was left."""

    answers: list[str]
    late: str  # a request sent just after SIGTERM
    stop_s: float
    exit_code: int | None
    left_behind: list[int]
    unanswered: int
    held: int = 0  # requests queued or running when the signal went out
    step_s: float = 0.0  # mean seconds per denoising step before the signal: this machine's pace


PENDING = "nv_inference_pending_request_count"
HELD = "neopp_engine_requests"  # requests the model's engine holds (its owner's label)
DONE = ("nv_inference_request_success", "nv_inference_request_failure")


def _queue_state(metrics_url: str, model: str) -> tuple[float, float, float, float]:
    """(held, answered, steps, step seconds) of ``model`` from one scrape of the metrics; held:
    waiting in Triton's queue for an instance, or in the engine (running or waiting for a step)."""
    series = [(n, v) for n, labels, v in _series(metrics_url) if labels.get("model") == model]
    total = lambda *names: sum(v for n, v in series if n in names)  # noqa: E731
    return total(PENDING, HELD), total(*DONE), total(STEPS_METRIC), total("neopp_step_seconds_total")


def _work(inputs: Inputs) -> float:
    """Pixels x steps of a request (0 when not given): the heaviest one is sent first."""
    size, steps = inputs.get("SIZE"), inputs.get("STEPS")
    pixels = float(np.prod(size[0])) if size is not None else 0.0
    return pixels * (float(steps[0][0]) if steps is not None else 1.0)


def _require(what: str, condition: Callable[[], bool], timeout: float) -> None:
    if not wait_for(condition, timeout, poll=0.1):
        raise RuntimeError(f"not reached within {timeout:.0f}s: {what}")


class _Senders:
    """One thread per request, each with a client made up front (so which protocol goes where is
    fixed by the order of sending); answers are ``ok``, ``error: ...`` or ``no answer``."""

    def __init__(self, make_client: Callable[[], Any], model: str, timeout: float) -> None:
        self.make_client, self.model, self.timeout = make_client, model, timeout
        self.answers: dict[int, str] = {}
        self.threads: list[threading.Thread] = []

    def send(self, key: int, inputs: Inputs) -> None:
        client = self.make_client()

        def run() -> None:
            try:
                infer(client, self.model, inputs, timeout=self.timeout)
                self.answers[key] = "ok"
            except Exception as exc:  # noqa: BLE001 - a clean error is an acceptable answer
                self.answers[key] = f"error: {type(exc).__name__}: {exc}"
            finally:
                client.close()

        thread = threading.Thread(target=run, name=f"sigterm-request-{key}")
        thread.start()
        self.threads.append(thread)

    def join(self, timeout: float) -> int:
        """Wait for every answer (one deadline for all); returns how many threads still run."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return sum(t.is_alive() for t in self.threads)


def _hold_all(server: Any, senders: _Senders, requests: list[Inputs], timeout: float) -> tuple[int, float]:
    """Send the heaviest request, wait until it runs, send the rest, wait until the server holds them.

    A request is held once Triton queued it for an instance or the model's engine took it; with
    none answered yet, held == len means all were received (an HTTP request still being read at
    the signal would hold the shutdown until its client gives up). Returns (held, seconds per step
    so far).
    """
    url, model, n = server.metrics_url, senders.model, len(requests)
    order = sorted(range(n), key=lambda i: -_work(requests[i]))
    _, done0, steps0, secs0 = _queue_state(url, model)
    senders.send(order[0], requests[order[0]])
    _require(f"{model}: the first request runs a step", lambda: _queue_state(url, model)[2] > steps0, timeout)
    for i in order[1:]:
        senders.send(i, requests[i])
    _require(f"{model}: {n} requests held", lambda: _queue_state(url, model)[0] >= n, timeout)
    pending, done, steps, secs = _queue_state(url, model)
    if done != done0:
        raise RuntimeError(f"{model}: a request finished before all {n} were held; make the first longer")
    return int(pending), (secs - secs0) / max(steps - steps0, 1.0)


def sigterm_in_flight(server: Any, make_client: Callable[[], Any], model: str, requests: list[Inputs],
                      started: Callable[[], bool] | None = None, answer_timeout: float = 120.0,
                      group: bool = False) -> Shutdown:
    """Send ``requests``, SIGTERM the server once it holds them all (and ``started()``, if given),
    send one more, collect every answer.

    ``server`` is a started ``TritonServer`` whose ``model`` has one instance; its process group
    is checked for leftovers. ``group``: SIGTERM the whole process group (server and stubs), as
    a service manager does. Every wait is bounded by ``answer_timeout``.
    """
    from neopp.procs import process_group_members

    senders = _Senders(make_client, model, answer_timeout)
    pending, step_s = _hold_all(server, senders, requests, answer_timeout)
    if started is not None:
        _require("started()", started, answer_timeout)
    pgid = server.process.pid
    t0 = time.monotonic()
    if group:
        os.killpg(pgid, signal.SIGTERM)
    else:
        server.process.send_signal(signal.SIGTERM)
    late = len(requests)
    senders.send(late, min(requests, key=_work))
    try:
        code = server.process.wait(timeout=answer_timeout)
    except Exception:  # noqa: BLE001 - reported as a hang; stop() below kills it
        code = None
    stop_s = time.monotonic() - t0
    unanswered = senders.join(answer_timeout)
    left = process_group_members(pgid)
    server.stop(timeout=10)  # closes the log; kills anything left (reported above)
    answers = [senders.answers.get(i, "no answer") for i in range(late + 1)]
    return Shutdown(answers[:-1], answers[-1], stop_s, code, left, unanswered, pending, step_s)
