"""CFG-parallel and Ulysses ranks (real processes, gloo) against the sequential pipeline.

Tolerance: each rank runs the same float32 layer code on its branch / token shard; CFG
parallelism only moves velocities between processes, Ulysses changes which rank computes
which heads and the thread count changes matmul blocking. Those are reassociations of float32
sums of O(1) terms over widths <= 256, so differences stay at a few float32 ulps of the
O(10) velocities: we allow 1e-4 absolute, far below the O(1) differences a wrong shard,
head or branch would cause (checked by the negative control below).
"""

from __future__ import annotations

import pytest
import torch

from neopp.model.kv_cache import load_kv_file
from neopp.modes import load_mode
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing.ranks import run_ranks
from testing.tiny_checkpoint import write_sample_kv, write_tiny_checkpoint

MODES = {"cfg": "configs/neopp/neopp_dense_parallel_cfg.json",
         "cfg_seq": "configs/neopp/neopp_dense_parallel_cfg_seq.json"}
STEPS = 4
ATOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("par")
    path = write_tiny_checkpoint(root / "dense", "dense", seed=3)
    kv = write_sample_kv(root / "kv", "dense", cond_tokens=21, uncond_tokens=5)
    return path, kv


def _request(kv: dict, mode_path: str, interval, height=96, width=160) -> GenerationRequest:
    sampling = load_mode(mode_path).sampling_params.replace(infer_steps=STEPS, cfg_interval=interval)
    return GenerationRequest(cond_kv=load_kv_file(kv["cond_pt"]), uncond_kv=load_kv_file(kv["uncond_pt"]),
                             index_offset_cond=40, index_offset_uncond=7, height=height, width=width,
                             noise=NoiseStream(11).draw(height, width), sampling_params=sampling)


def _rank(rank: int, world: int, port: int, ckpt: str, kv: dict, mode_path: str, interval, out) -> None:
    torch.set_num_threads(1)
    from neopp.parallel.mesh import init_mesh
    from neopp.parallel.parallel_pipeline import ParallelPipeline

    mode = load_mode(mode_path)
    mesh = init_mesh(mode, rank, world, f"tcp://127.0.0.1:{port}", torch.device("cpu"), 60)
    pipe = ParallelPipeline.from_pretrained(ckpt, mode, mesh, "cpu", torch.float32)
    req = _request(kv, mode_path, interval)
    prep = pipe.prepare(req)
    x = req.noise * prep.noise_scale
    from neopp.model.embeddings import patchify

    z = patchify(x, prep.grid.token_size)
    with torch.inference_mode():
        vs = [pipe.step_velocity(prep, x, z, k, req.sampling_params) for k in range(STEPS)]
        final = pipe.sample(req)
    out.put((rank, torch.stack(vs).numpy(), final.numpy()))  # by value: the rank exits next


def _run_ranks(world: int, ckpt, kv, mode_path: str, interval) -> dict:
    results = run_ranks(_rank, world, (str(ckpt), kv, mode_path, interval), timeout_s=120)
    return {rank: (torch.from_numpy(vs), torch.from_numpy(final)) for rank, (vs, final) in results.items()}


@pytest.mark.parametrize("name,world", [("cfg", 2), ("cfg_seq", 4)])
@pytest.mark.parametrize("interval", [(-1.0, 2.0), (0.3, 0.8)], ids=["always", "partial"])
def test_parallel_velocities_match_sequential(ckpt, name, world, interval):
    path, kv = ckpt
    mode_path = MODES[name]
    seq = NeoPPPipeline.from_pretrained(path, load_mode("configs/neopp/neopp_dense.json"), "cpu", torch.float32)
    req = _request(kv, mode_path, interval)
    prep = seq.prepare(req)
    assert 0 < sum(prep.plan.guided_steps) <= STEPS
    from neopp.model.embeddings import patchify

    x = req.noise * prep.noise_scale
    z = patchify(x, prep.grid.token_size)
    with torch.inference_mode():
        expected = torch.stack([seq.step_velocity(prep, x, z, k, req.sampling_params) for k in range(STEPS)])
        expected_final = seq.sample(_request(kv, mode_path, interval))
    results = _run_ranks(world, path, kv, mode_path, interval)
    assert sorted(results) == list(range(world))
    for rank, (vs, final) in results.items():
        assert (vs - expected).abs().max().item() < ATOL, f"rank {rank} velocity differs"
        assert (final - expected_final).abs().max().item() < ATOL, f"rank {rank} final image differs"
    # Negative control: the uncond-only velocity is far from the guided one.
    assert (expected[0] - seq.velocity(seq.embed(x, prep, 0), z, prep, 0, prep.uncond)).abs().max() > 100 * ATOL
