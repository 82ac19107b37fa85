"""Process lookups stay inside one server: two look-alike servers on one host, each with a stub
of the same model (one with spawned rank workers); every lookup from one server's pid finds
only its own processes, and signalling the other's is refused.

The "servers" are real process groups whose children carry a Python stub's command line (argv[0]
named triton_python_backend_stub, the model's model.py, the instance name at argv[8])."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from neopp.procs import model_stubs, process_group_members, server_processes, stub_instance
from testing.faults import rank_pids, signal_own

MODEL_PY = """
import multiprocessing, sys, time
if __name__ == "__main__":
    if sys.argv[-1].startswith("neopp_dense_cfg_"):
        for _ in range(2):
            multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,), daemon=True).start()
    time.sleep(120)
"""

SERVER_PY = """
import subprocess, sys, time
stub, repo = sys.argv[1], sys.argv[2]
for model in ("neopp_dense", "neopp_dense_cfg"):
    argv = [stub, f"{repo}/{model}/1/model.py", "shm", "1", "2", "0", "lib", "key", f"{model}_0_0"]
    subprocess.Popen(argv)
time.sleep(120)
"""


def _repo(root: Path) -> Path:
    for model in ("neopp_dense", "neopp_dense_cfg"):
        (root / model / "1").mkdir(parents=True)
        (root / model / "1" / "model.py").write_text(textwrap.dedent(MODEL_PY))
    return root


def _start_server(tmp: Path, name: str) -> subprocess.Popen:
    stub = tmp / name / "triton_python_backend_stub"
    stub.parent.mkdir()
    stub.symlink_to(sys.executable)
    script = tmp / name / "server.py"
    script.write_text(textwrap.dedent(SERVER_PY))
    return subprocess.Popen([sys.executable, str(script), str(stub), str(_repo(tmp / name / "repo"))],
                            start_new_session=True)


def _wait_ranks(server: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if len(rank_pids(server.pid, "neopp_dense_cfg")) == 2 and model_stubs(server.pid, "neopp_dense"):
                return
        except RuntimeError:  # stub not started yet
            pass
        time.sleep(0.1)
    raise AssertionError(f"fake server {server.pid} did not start its stubs and ranks in {timeout}s")


@pytest.fixture()
def two_servers(tmp_path):
    servers = [_start_server(tmp_path, "a"), _start_server(tmp_path, "b")]
    try:
        for s in servers:
            _wait_ranks(s)
        yield servers
    finally:
        for s in servers:
            os.killpg(s.pid, signal.SIGKILL)  # our own groups, started above
            s.wait(timeout=30)


def test_lookups_from_one_server_never_select_the_other(two_servers):
    a, b = two_servers
    own = {s.pid: set(server_processes(s.pid)) for s in two_servers}
    assert own[a.pid] and own[b.pid] and not own[a.pid] & own[b.pid]
    assert own[a.pid] <= set(process_group_members(a.pid))
    for s in two_servers:
        stubs = model_stubs(s.pid, "neopp_dense") + model_stubs(s.pid, "neopp_dense_cfg")
        assert len(stubs) == 2 and set(stubs) <= own[s.pid]
        assert set(rank_pids(s.pid, "neopp_dense_cfg")) <= own[s.pid]
    assert model_stubs(a.pid, "neopp_dense") != model_stubs(b.pid, "neopp_dense")
    assert model_stubs(a.pid, "neopp_dense_c") == []  # an instance name is matched whole


def test_signalling_another_servers_process_is_refused(two_servers):
    a, b = two_servers
    foreign = rank_pids(b.pid, "neopp_dense_cfg")[0]
    with pytest.raises(RuntimeError, match="not a process of tritonserver"):
        signal_own(a.pid, foreign)
    assert foreign in server_processes(b.pid)  # untouched
    mine = rank_pids(a.pid, "neopp_dense_cfg")[0]
    signal_own(a.pid, mine)
    deadline = time.monotonic() + 30
    while mine in server_processes(a.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mine not in server_processes(a.pid)


def test_stub_instance_reads_the_instance_name():
    argv = ["/x/triton_python_backend_stub", "/r/neopp_dense/1/model.py", "s", "1", "2", "3", "l", "k",
            "neopp_dense_0_0"]
    assert stub_instance(argv) == "neopp_dense_0_0"
    assert stub_instance(["/usr/bin/python3", *argv[1:]]) is None
    assert stub_instance(argv[:8]) is None
