"""Rank worker pool: configuration checks, faults, cancellation, and no orphan processes."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from neopp.engines.factory import build_engine
from neopp.engines.rank_pool import WorkerFailure
from neopp.engines.spec import EngineSpec
from neopp.errors import ConfigError, GenerationCancelled, InputError
from neopp.model.kv_cache import load_kv_file
from neopp.modes import load_mode
from neopp.parallel.mesh import check_world
from neopp.request import GenerationRequest
from neopp.sampling.rng import NoiseStream
from testing.tiny_checkpoint import write_sample_kv, write_tiny_checkpoint

CFG_MODE = "configs/neopp/neopp_dense_parallel_cfg.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split()[2] != "Z"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    ckpt = write_tiny_checkpoint(root / "dense", "dense", seed=5)
    kv = write_sample_kv(root / "kv", "dense", cond_tokens=9, uncond_tokens=4)
    pool = build_engine(EngineSpec.local(ckpt, load_mode(CFG_MODE), threads=1, collective_timeout_s=5.0))
    yield pool, kv
    pool.close()


def _req(kv, steps: int, seed: int = 1) -> GenerationRequest:
    sampling = load_mode(CFG_MODE).sampling_params.replace(infer_steps=steps)
    return GenerationRequest(cond_kv=load_kv_file(kv["cond_pt"]), uncond_kv=load_kv_file(kv["uncond_pt"]),
                             index_offset_cond=12, index_offset_uncond=4, height=64, width=64,
                             noise=NoiseStream(seed).draw(64, 64), sampling_params=sampling)


def test_world_size_must_match_parallel_sizes():
    with pytest.raises(ConfigError, match="must equal the product of the parallel sizes"):
        check_world(load_mode(CFG_MODE), 3)


def test_kill_rank_between_requests_recovers(setup):
    pool, kv = setup
    expected = pool.generate(_req(kv, 3))
    victim = pool.pids()[1]
    os.kill(victim, signal.SIGKILL)
    time.sleep(0.2)
    assert (pool.generate(_req(kv, 3)) == expected).all()
    assert victim not in pool.pids()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["rank-dies", "collective-hangs"])
def test_fault_during_request_fails_cleanly_then_recovers(setup, sig):
    pool, kv = setup
    expected = pool.generate(_req(kv, 3))
    victim = pool.pids()[1]

    def on_step(k: int, seconds: float) -> None:
        if k == 1:
            os.kill(victim, sig)

    start = time.monotonic()
    with pytest.raises(WorkerFailure, match="restarted"):
        pool.generate(_req(kv, 400), on_step=on_step)
    # Bounded: detection by liveness polling, or the 5 s collective timeout for a hang.
    assert time.monotonic() - start < 30
    assert not _alive(victim)
    assert (pool.generate(_req(kv, 3)) == expected).all()


def test_cancel_stops_between_steps(setup):
    pool, kv = setup
    steps = []
    with pytest.raises(GenerationCancelled):
        pool.generate(_req(kv, 400), should_stop=lambda: len(steps) >= 2, on_step=lambda k, s: steps.append(k))
    assert len(steps) < 50
    assert pool.generate(_req(kv, 2)).shape == (64, 64, 3)


def test_close_leaves_no_process(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "d", "dense")
    pool = build_engine(EngineSpec.local(ckpt, load_mode(CFG_MODE), threads=1))
    pids = pool.pids()
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    pool.close()
    assert not any(_alive(p) for p in pids)


def test_non_finite_state_is_refused_and_the_group_stays_usable(setup):
    """Every rank holds the same state, so all stop at the same step: INVALID_ARG, no rebuild."""
    pool, kv = setup
    expected = pool.generate(_req(kv, 2))
    pids = pool.pids()
    bad = _req(kv, 2)
    bad.cond_kv = torch.full_like(bad.cond_kv, float(torch.finfo(torch.bfloat16).max))
    bad.uncond_kv = torch.full_like(bad.uncond_kv, float(torch.finfo(torch.bfloat16).max))
    with pytest.raises(InputError, match=r"^cond_kv: .*at step \d of 2"):
        pool.generate(bad)
    assert pool.pids() == pids, "a refused request must not restart the ranks"
    assert (pool.generate(_req(kv, 2)) == expected).all()
