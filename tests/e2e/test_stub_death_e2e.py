"""Stub health against the real launcher (the ``door`` fixture): it is judged from what the
launcher owns, never from error text. A stub stopped by a signal is replaced, not resumed; a
planted "not healthy" kills nothing; a busy stub is never killed; one stub death under traffic is
one reload (503 with Retry-After meanwhile, never 500, and the replica unready); a stub killed
holding a lock it shares with tritonserver is contained (the server aborts and the launcher brings
it back, or the model is reloaded); liveness holds while idle connections fill the door.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from neopp.launcher.door.bounds import DoorLimits
from neopp.launcher.stub_kill import holds_robust_lock
from neopp.ports import LOOPBACK
from neopp.procs import model_stubs
from testing.door_attacks import post
from testing.door_requests import MODEL, alive, grpc_image, http_infer, tensors
from testing.faults import wait_for
from testing.stub_recovery import stub_death_under_traffic

SIBLINGS_GONE_S = 30


def test_a_stopped_stub_is_killed_and_its_model_reloaded(door, kv):
    pid = door.server_pid
    expected = grpc_image(door, kv, seed=11)
    stubs = model_stubs(pid, MODEL)  # every instance: whichever one Triton picks is stopped
    for stub in stubs:
        os.kill(stub, signal.SIGSTOP)
    try:
        client = httpclient.InferenceServerClient(f"{LOOPBACK}:{door.http_port}", network_timeout=120.0)
        with pytest.raises(InferenceServerException):  # Triton answers "not healthy" after 1 s
            client.infer(MODEL, tensors(httpclient, kv, seed=11))
        client.close()
        for stub in stubs:
            door.wait_for(rf"neopp watchdog: {MODEL}_\d+_\d+: .*killing its stub {stub} \(SIGKILL\)", timeout=60)
    finally:
        for stub in stubs:
            try:
                os.kill(stub, signal.SIGCONT)  # what aborted tritonserver when the stub was resumed
            except ProcessLookupError:
                pass
    door.wait_for(rf"neopp watchdog: {MODEL}: reload done", timeout=120)
    deadline, got = time.monotonic() + 120, None
    while got != expected and time.monotonic() < deadline:
        try:
            got = grpc_image(door, kv, seed=11)
        except InferenceServerException:
            time.sleep(0.5)
    assert got == expected
    alive(door, pid)


def test_a_planted_not_healthy_text_kills_no_stub(door, kv):
    """Triton echoes a client's input names in its errors: the text decides nothing."""
    pid = door.server_pid
    stubs = model_stubs(pid, MODEL)
    planted = f"Stub process '{MODEL}_0_0' is not healthy"
    body = json.dumps({"inputs": [{"name": planted, "shape": [1], "datatype": "INT64", "data": [1]}]}).encode()
    for route in ("infer", "generate"):
        status, _, answer = post(door.http_port, f"/v2/models/{MODEL}/{route}", body)
        assert status == 400, (route, answer[:300])
    client = grpcclient.InferenceServerClient(f"{LOOPBACK}:{door.grpc_port}")
    planted_input = grpcclient.InferInput(planted, [1], "INT64")
    planted_input.set_data_from_numpy(np.array([1], np.int64))
    with pytest.raises(InferenceServerException, match="not healthy"):
        client.infer(MODEL, [planted_input])
    client.close()
    assert grpc_image(door, kv)  # answered by the same stubs: nothing was killed or reloaded
    assert model_stubs(pid, MODEL) == stubs
    assert not any(f"killing its stub {stub}" in door.text() for stub in stubs)


def test_a_busy_stub_is_never_killed(door, kv):
    """A long legitimate request (512x512, 150 steps) outlasts the hung rule many times, with
    requests beside it: its engine computes (CPU advances), so the model keeps its stubs."""
    pid = door.server_pid
    stubs, killed = model_stubs(pid, MODEL), len(re.findall("killing its stub", door.text()))
    answers: list[str] = []

    def send(size: int, steps: int, seed: int) -> None:
        c = httpclient.InferenceServerClient(f"{LOOPBACK}:{door.http_port}", network_timeout=900.0)
        try:
            c.infer(MODEL, tensors(httpclient, kv, size=(size, size), steps=steps, seed=seed))
            answers.append("ok")
        except InferenceServerException as exc:
            answers.append(f"{exc.status()} {exc.message()}")
        finally:
            c.close()

    started, steps = time.monotonic(), _steps(door)
    threads = [threading.Thread(target=send, args=(512, 150, 1))]
    threads[0].start()
    wait_for(lambda: _steps(door) > steps or not threads[0].is_alive(), 120, poll=0.05)  # it runs: queue more
    threads += [threading.Thread(target=send, args=(32, 2, seed)) for seed in (2, 3)]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout=900)
    print(f"a 512x512, 150-step request and two behind it: {time.monotonic() - started:.1f}s, {answers}")
    assert answers == ["ok"] * 3
    assert model_stubs(pid, MODEL) == stubs and len(re.findall("killing its stub", door.text())) == killed


def _steps(door) -> float:
    """Denoising steps the model has run (its own metric on Triton's metrics port)."""
    text = urllib.request.urlopen(f"http://{LOOPBACK}:{door.metrics_port}/metrics", timeout=10).read().decode()
    match = re.search(rf'^neopp_denoising_steps_total\{{model="{MODEL}"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_one_stub_death_under_traffic_is_one_recovery(door, kv):
    """A stub SIGKILLed while a client keeps calling: one reload, no loop, serving again as soon as
    the reload is done; meanwhile every answer is the image or 503 with Retry-After (never a 500)
    and the replica says it is not ready."""
    pid = door.server_pid
    expected = grpc_image(door, kv, seed=31)
    before = set(model_stubs(pid, MODEL))

    def send() -> tuple[int, dict[str, str], bool]:
        status, headers, image = http_infer(door, kv, seed=31)
        return status, headers, image == expected

    death = stub_death_under_traffic(door, MODEL, send)
    deadline = time.monotonic() + SIBLINGS_GONE_S  # the killed stub's siblings go with their generation
    while (left := before & set(model_stubs(pid, MODEL))) and time.monotonic() < deadline:
        time.sleep(0.5)
    print(f"siblings of the killed stub still running after the reload: {sorted(left)}; "
          f"ended by the watchdog: {door.text().count('of a replaced instance')}")
    assert not left, f"stubs of the replaced instances still running: {sorted(left)}\n{door.text()[-3000:]}"
    print(f"stub SIGKILL under traffic: {death.summary(MODEL)}\n"
          + "\n".join(line for line in death.log.splitlines() if "watchdog" in line or "warm-up" in line))
    assert all(right or (status == 503 and retry) for _, status, retry, right in death.answers), death.answers
    assert death.reloads(MODEL) == 1 and death.log.count(f"neopp watchdog: {MODEL}: reload done") == 1, death.log
    assert "reload failed" not in death.log and "killing its stub" not in death.log and door.server_pid == pid
    reload_s = float(re.search(rf"neopp watchdog: {MODEL}: reload done in ([\d.]+)s", death.log).group(1))
    assert death.recovery_s < reload_s + 5, "the launcher's own part: noticing the death and saying it is back"
    assert any(code != 200 for _, *codes in death.readiness for code in codes), "never unready while broken"
    assert death.readiness[-1][1:] == (200, 200)


def test_grpc_clients_see_unavailable_while_a_killed_stub_is_replaced(door, kv):
    """Over the public gRPC port (the launcher's gRPC front) a stub's death under traffic is the
    image or UNAVAILABLE, never Triton's INTERNAL "not healthy", and one reload."""
    expected = grpc_image(door, kv, seed=37)
    client = grpcclient.InferenceServerClient(f"{LOOPBACK}:{door.grpc_port}")
    codes: list[str] = []

    def send() -> tuple[int, dict[str, str], bool]:
        try:
            image = client.infer(MODEL, tensors(grpcclient, kv, seed=37), client_timeout=120).as_numpy("IMAGE")[0]
        except InferenceServerException as exc:
            codes.append(f"{exc.status()} {exc.message()[:200]}")
            return 503 if exc.status() == "StatusCode.UNAVAILABLE" else 500, {"retry-after": "gRPC"}, False
        return 200, {}, bytes(image) == expected

    try:
        death = stub_death_under_traffic(door, MODEL, send)
    finally:
        client.close()
    print(f"gRPC under a stub death: {death.summary(MODEL)}; refusals {sorted(set(codes))[:4]}")
    assert all(right or status == 503 for _, status, _, right in death.answers), codes
    assert death.reloads(MODEL) == 1, death.log


def test_a_stub_killed_holding_a_shared_lock_is_contained(door, kv):
    """What aborted tritonserver under load, done on purpose: SIGKILL the stub at a moment the kernel
    lists a robust mutex it shares with the server as held (what neopp.launcher.stub_kill never does).
    When the server takes that lock again, Triton 2.51 aborts (lock_exception, signal 6) and the
    launcher restarts it; when it never does (a lock of one message), the watchdog reloads the model.
    Either way the door answers only the image or 503 with Retry-After, and the replica comes back."""
    expected, pid = grpc_image(door, kv, seed=41), door.server_pid

    def send() -> tuple[int, dict[str, str], bool]:
        status, headers, image = http_infer(door, kv, seed=41)
        return status, headers, image == expected

    looks: list[int] = []

    def kill_holding_a_lock(server_pid: int, stub: int) -> None:
        stop = threading.Event()

        def traffic() -> None:  # many short steps: a stub with a request talks to the server all the time
            client = grpcclient.InferenceServerClient(f"{LOOPBACK}:{door.grpc_port}")
            while not stop.is_set():
                try:
                    client.infer(MODEL, tensors(grpcclient, kv, size=(32, 32), steps=40), client_timeout=60)
                except InferenceServerException:
                    break
            client.close()

        # one client per instance, so the stub always holds a request whichever instance it is
        workers = [threading.Thread(target=traffic) for _ in model_stubs(server_pid, MODEL)]
        for worker in workers:
            worker.start()
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                looks.append(1)
                os.kill(stub, signal.SIGSTOP)
                if holds_robust_lock(stub):
                    os.kill(stub, signal.SIGKILL)
                    return
                os.kill(stub, signal.SIGCONT)
                time.sleep(0.02)  # mostly running: never stopped long enough for the watchdog's rule
            os.kill(stub, signal.SIGCONT)
            pytest.fail(f"the stub never held a shared lock in {len(looks)} looks")
        finally:
            stop.set()
            for worker in workers:
                worker.join(timeout=120)

    death = stub_death_under_traffic(door, MODEL, send, timeout_s=300, kill=kill_holding_a_lock)
    aborted = "tritonserver exited with code -6" in death.log
    print(f"SIGKILL while holding a shared lock (after {len(looks)} looks): "
          f"{'tritonserver aborted' if aborted else 'tritonserver lived'}; {death.summary(MODEL)}")
    assert all(right or (status == 503 and retry) for _, status, retry, right in death.answers), death.answers
    if aborted:
        assert "boost::interprocess::lock_exception" in death.log and door.server_pid != pid
    else:
        assert death.log.count(f"neopp watchdog: {MODEL}: reload done") == 1 and door.server_pid == pid
    assert death.readiness[-1][1:] == (200, 200)


def test_liveness_holds_while_idle_connections_fill_the_door(door):
    """The liveness probe reads the launcher's alive file: it never connects to the door."""
    alive = door.log.parent / "alive"
    env = {**os.environ, "NEOPP_ALIVE_FILE": str(alive), "NEOPP_ALIVE_MAX_AGE_S": "30"}
    probe = [sys.executable, str(Path(__file__).parents[2] / "docker" / "live.py")]
    assert subprocess.run(probe, env=env, timeout=60).returncode == 0
    idle = []
    try:
        for _ in range(DoorLimits().max_connections + 8):
            idle.append(socket.create_connection((LOOPBACK, door.http_port), timeout=10))
        touched = alive.stat().st_mtime
        assert wait_for(lambda: alive.stat().st_mtime > touched, 30, poll=0.2), "the launcher stopped marking itself"
        result = subprocess.run(probe, env=env, timeout=60, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout
    finally:
        for sock in idle:
            sock.close()
    stale = {**env, "NEOPP_ALIVE_MAX_AGE_S": "0"}
    assert subprocess.run(probe, env=stale, timeout=60, capture_output=True).returncode == 1
