"""Rank processes of the multi-rank models through a real server: frozen ranks, killed stubs,
repeated starts.

Each test runs its own server (the shared one must keep a healthy `neopp_dense_cfg`).
Processes are found only below the server this file started (its process tree and group).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import MOE_MODELS, TritonHandle, ensure_8steps_lora
from tritonclient.utils import InferenceServerException

from neopp.launcher.model_states import KEEP_GOING_ARGS
from neopp.launcher.tritonserver import TritonServer
from neopp.model.kv_cache import load_kv_file
from neopp.procs import cmdline, descendants, process_group_members
from testing import REPO as REPO_ROOT
from testing.faults import kill_own_stub, stub_pid

MULTI_RANK = ("neopp_dense_cfg", "neopp_dense_cfg_seq", "neopp_moe_cfg")
STEPS_METRIC = "neopp_denoising_steps_total"
COLLECTIVE_TIMEOUT_S = 120  # config.pbtxt of neopp_dense_cfg
START_LIMIT_S = 180         # a normal start takes 30-90 s here (2 busy cores); a hung one never ends
START_CYCLES = 3  # bounded: each start loads three multi-rank models (about a minute here)


def _server(tmp: Path, dense: Path, moe: Path, models: tuple[str, ...], tag: str) -> TritonServer:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEOPP_CHECKPOINT_", "NEOPP_LORA_DIR_"))}
    env["NEOPP_CHECKPOINT"] = str(dense)
    env.update({"NEOPP_CHECKPOINT_" + m.upper(): str(moe) for m in MOE_MODELS})
    env["NEOPP_LORA_DIR"] = str(ensure_8steps_lora().parent)
    return TritonServer(REPO_ROOT / "model_repository", env=env, log_path=tmp / f"{tag}.log",
                        extra_args=["--model-control-mode=explicit", "--exit-timeout-secs=15",
                                    *KEEP_GOING_ARGS,  # an abandoned load is rescued and retried
                                    *(f"--load-model={m}" for m in models)])


def _stop(server: TritonServer) -> None:
    pgid = server.process.pid
    server.stop(timeout=30)
    assert not process_group_members(pgid), "the server left processes behind"


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


@pytest.fixture(scope="module")
def cfg_server(tiny_dense: Path, tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory):
    server = _server(tmp_path_factory.mktemp("ranks"), tiny_dense, tiny_moe, ("neopp_dense_cfg",), "cfg")
    server.start()
    try:
        server.wait_ready(timeout=300)
        kv = tiny_dense / "sample_kv"
        handle = TritonHandle(server, tiny_dense, load_kv_file(kv / "cond_kv.pt"),
                              load_kv_file(kv / "uncond_kv.pt"), server.log_path)
        yield handle
        handle.close()
    finally:
        _stop(server)


def _stub(server: TritonServer, model: str) -> int:
    """The stub of the model's first instance: the one that loads the engine and its ranks."""
    return stub_pid(server.process.pid, model)


def _ranks(server: TritonServer, model: str) -> list[int]:
    return [p for p in descendants(_stub(server, model)) if any("spawn_main" in part for part in cmdline(p))]


def _infer(handle: TritonHandle, model: str, **overrides):
    return handle.grpc.infer(model, handle.grpc_tensors(**overrides), client_timeout=300)


def test_frozen_rank_fails_request_fast_then_recovers(cfg_server: TritonHandle):
    model, seed = "neopp_dense_cfg", np.array([5], np.int64)
    expected = _infer(cfg_server, model, SEED=seed).as_numpy("IMAGE")[0]
    victim = _ranks(cfg_server.server, model)[-1]
    outcome: dict = {}

    def long_request() -> None:
        try:
            _infer(cfg_server, model, SEED=seed, STEPS=np.array([200], np.int64),
                   SIZE=np.array([256, 256], np.int64))
            outcome["result"] = "ok"
        except InferenceServerException as exc:
            outcome["error"] = exc
            outcome["at"] = time.monotonic()

    before = cfg_server.metric(STEPS_METRIC, model=model)
    worker = threading.Thread(target=long_request)
    worker.start()
    assert cfg_server.wait_metric(STEPS_METRIC, before + 2, model=model, timeout=120) >= before + 2
    stopped_at = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    try:
        worker.join(timeout=COLLECTIVE_TIMEOUT_S)
    finally:
        if not _gone(victim):
            os.kill(victim, signal.SIGCONT)  # only if the pool did not replace it
    assert not worker.is_alive() and "error" in outcome, outcome
    error = outcome["error"]
    assert error.status() == "StatusCode.UNAVAILABLE", error
    assert f"pid {victim}" in str(error) and "restarted" in str(error), error
    noticed_s = outcome["at"] - stopped_at
    assert noticed_s < COLLECTIVE_TIMEOUT_S / 6, f"frozen rank noticed after {noticed_s:.1f}s"
    assert _infer(cfg_server, model, SEED=seed).as_numpy("IMAGE")[0] == expected
    assert victim not in _ranks(cfg_server.server, model)


def test_killed_stub_leaves_no_rank_behind(cfg_server: TritonHandle):
    """Runs last on this server: its model has no stub afterwards."""
    stub = _stub(cfg_server.server, "neopp_dense_cfg")
    children = descendants(stub)  # the ranks and the multiprocessing resource tracker
    assert len([p for p in children if any("spawn_main" in c for c in cmdline(p))]) == 2, children
    kill_own_stub(cfg_server.server.process.pid, stub)
    deadline = time.monotonic() + 30
    while any(not _gone(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = {p: cmdline(p)[-3:] for p in children if not _gone(p)}
    assert not survivors, f"processes of the killed stub survived it: {survivors}"


def test_multi_rank_models_start_every_time(tiny_dense: Path, tiny_moe: Path, tmp_path: Path):
    """Bounded repeated starts: any start over START_LIMIT_S fails (a hung load never ends)."""
    times = []
    for cycle in range(START_CYCLES):
        server = _server(tmp_path, tiny_dense, tiny_moe, MULTI_RANK, f"start{cycle}")
        started = time.monotonic()
        server.start()
        try:
            server.wait_ready(timeout=START_LIMIT_S)
            times.append(round(time.monotonic() - started, 1))
            client = grpcclient.InferenceServerClient(server.grpc_url)
            assert all(client.is_model_ready(m) for m in MULTI_RANK), server.log_tail()
            client.close()
        finally:
            _stop(server)
    print(f"start times (s): {times}")
