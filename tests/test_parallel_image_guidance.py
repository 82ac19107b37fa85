"""Image-editing guidance on CFG-parallel (2 ranks) and CFG + Ulysses (4 ranks) meshes, float32,
against the float64 reference (real rank processes over gloo).

Each rank receives what the worker pool sends it (`rank_request`: only its branches' KV) and
runs the mesh's layout; every rank must end with the reference's image. Tolerance as in
tests/test_image_guidance.py (X_RTOL, float32 against float64): spreading branches over ranks
only moves velocities between processes and reassociates sums (tests/test_parallel_engine.py).
On 2 ranks every pairing of the three branches is run, since the benchmark chooses among them.
"""

from __future__ import annotations

import pytest
import torch

from neopp.modes import load_mode
from testing.ranks import run_ranks
from testing.tiny_checkpoint import write_tiny_checkpoint
from tests.reference import neopp_reference as ref
from tests.test_image_guidance import CASES, SHIFT, STEPS, X_RTOL, H, W, image_request, x_err

MODES = {2: "configs/neopp/neopp_dense_parallel_cfg.json", 4: "configs/neopp/neopp_dense_parallel_cfg_seq.json"}
LAYOUTS = {"cond|uncond+image": (("cond",), ("uncond", "image")),
           "cond+uncond|image": (("cond", "uncond"), ("image",)),
           "cond+image|uncond": (("cond", "image"), ("uncond",))}
THREE = ("three-branches", "open-interval")
OTHER = ("image-scale-one", "equal-scales", "both-one", "cfg-disabled")


def jobs(world: int) -> list[tuple[str, str]]:
    """(case, layout name): every layout on 2 ranks, the engine's default on 4."""
    layouts = list(LAYOUTS) if world == 2 else ["cond|uncond+image"]
    return [(c, lay) for c in THREE for lay in layouts] + [(c, "cond|uncond+image") for c in OTHER]


def _rank(rank: int, world: int, port: int, ckpt: str, out) -> None:
    torch.set_num_threads(1)
    from neopp.parallel.mesh import init_mesh
    from neopp.parallel.parallel_pipeline import ParallelPipeline
    from neopp.parallel.rank_step import rank_request

    mode = load_mode(MODES[world])
    mesh = init_mesh(mode, rank, world, f"tcp://127.0.0.1:{port}", torch.device("cpu"), 60)
    pipe = ParallelPipeline.from_pretrained(ckpt, mode, mesh, "cpu", torch.float32)
    results = []
    for case, layout in jobs(world):
        pipe.three_branch_split = LAYOUTS[layout]
        req = rank_request(mode, image_request(case), rank, LAYOUTS[layout])
        with torch.inference_mode():
            results.append(pipe.sample(req).numpy())
    out.put((rank, results))


def _run_ranks(world: int, ckpt) -> dict:
    results = run_ranks(_rank, world, (str(ckpt),), timeout_s=300)
    return {rank: [torch.from_numpy(x) for x in finals] for rank, (finals,) in results.items()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("par_i2i") / "dense", "dense", seed=0)
    return path, ref.RefModel(path)


@pytest.mark.parametrize("world", [2, 4], ids=["cfg", "cfg_seq"])
def test_parallel_image_editing_matches_reference(ckpt, world):
    path, model = ckpt
    from neopp.sampling.rng import NoiseStream
    from tests.test_image_guidance import PREFIXES

    expected = {}
    for case in {c for c, _ in jobs(world)}:
        s, s_img, interval, norm, enable, _ = CASES[case]
        expected[case], _ = ref.reference_generate_image_edit(model, PREFIXES, H, W, NoiseStream(9).draw(H, W),
                                                              STEPS, SHIFT, s, s_img, interval, norm, enable)
    results = _run_ranks(world, path)
    assert sorted(results) == list(range(world))
    for rank, finals in results.items():
        for (case, layout), x in zip(jobs(world), finals, strict=True):
            assert x_err(x, expected[case]) <= X_RTOL, (rank, case, layout, x_err(x, expected[case]))
