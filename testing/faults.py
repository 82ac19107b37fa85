"""Fault scenarios against a real server, measured: what the client sees, how long recovery takes.

Used by the e2e tests (which assert on the outcome) and by ``testing.soak`` (which prints
it). Every wait is bounded; only processes of the server under test are signalled, by pid.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable

from testing.fuzz import Inputs
from testing.loadgen import image_bytes, infer
from neopp.serving.watchdog import model_stub_pids

STEPS_METRIC = "neopp_denoising_steps_total"


def metric(metrics_url: str, name: str, **labels: str) -> float:
    """Current value of one series (0 when absent)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    for line in text.splitlines():
        m = re.match(r"^(\w+)\{(.*)\} (\S+)$", line)
        if m and m.group(1) == name and dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))) == labels:
            return float(m.group(3))
    return 0.0


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


def kill_stub(client: Any, server_pid: int, model: str, inputs: Inputs, expected: bytes,
              during: Inputs | None = None, metrics_url: str | None = None,
              timeout: float = 120.0) -> StubKill:
    """SIGKILL the model's stub (while ``during`` runs, if given), then retry ``inputs`` until answered.

    Recovery needs something that reloads the model (a running ``StubWatchdog``).
    """
    pids = model_stub_pids(server_pid, model)
    if len(pids) != 1:
        raise RuntimeError(f"expected one stub for {model}, found {pids}")
    outcome = StubKill(model, pids[0])
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
            wait_for(lambda: metric(metrics_url, STEPS_METRIC, model=model) >= before + 1, 60)
    killed_at = time.monotonic()
    os.kill(outcome.killed_pid, signal.SIGKILL)
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
    later = {k: v for k, v in inputs.items() if k != "SEED"}
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


def sigterm_in_flight(server: Any, make_client: Callable[[], Any], model: str, requests: list[Inputs],
                      started: Callable[[], bool], answer_timeout: float = 120.0, group: bool = False) -> Shutdown:
    """Send ``requests`` concurrently, SIGTERM the server once ``started()``, collect every answer.

    ``server`` is a started ``TritonServer``; its process group is checked for leftovers.
    ``group``: SIGTERM the whole process group (server and stubs), as a service manager does.
    """
    from neopp.serving.procs import process_group_members

    answers: list[str | None] = [None] * len(requests)

    def send(i: int) -> None:
        client = make_client()
        try:
            infer(client, model, requests[i], timeout=answer_timeout)
            answers[i] = "ok"
        except Exception as exc:  # noqa: BLE001 - a clean error is an acceptable answer
            answers[i] = f"error: {type(exc).__name__}: {exc}"
        finally:
            client.close()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    wait_for(started, 60)
    pgid = server.process.pid
    t0 = time.monotonic()
    if group:
        os.killpg(pgid, signal.SIGTERM)
    else:
        server.process.send_signal(signal.SIGTERM)
    late = threading.Thread(target=send, args=(len(requests),))
    requests = [*requests, requests[0]]
    answers.append(None)
    time.sleep(0.2)
    late.start()
    threads.append(late)
    try:
        code = server.process.wait(timeout=answer_timeout)
    except Exception:  # noqa: BLE001 - reported as a hang; stop() below kills it
        code = None
    stop_s = time.monotonic() - t0
    for t in threads:
        t.join(timeout=answer_timeout)
    left = process_group_members(pgid)
    server.stop(timeout=10)  # closes the log; kills anything left (reported above)
    answers = [a or "no answer" for a in answers]
    return Shutdown(answers[:-1], answers[-1], stop_s, code, left,
                    sum(1 for t in threads if t.is_alive()))
