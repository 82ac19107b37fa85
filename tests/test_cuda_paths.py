"""The runner on a CUDA device against the same runner on the CPU (skipped without a GPU).

The CPU float32 path is the one checked against the float64 reference elsewhere; here the GPU
must reproduce it. Tolerances, in 8-bit pixel levels of the final image: float32 on the GPU
(cuDNN may run the patch convolutions in TF32, 10-bit mantissa) within 2 levels everywhere and
0.05 on average; bf16 (8-bit mantissa, a few steps compounding) 1.5 levels on average against
float32, 0.5 between its own batched and solo runs. A wrong
prefix, t or grid differs by tens of levels almost everywhere (tests/test_batching.py's
negative control), so these bounds still catch a wrong computation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neopp.engines.batch_engine import BatchingEngine
from neopp.sampling.pipeline import NeoPPPipeline
from testing.stream_requests import Collector, mixed, tiny_setup

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ckpt, cpu, kvs = tiny_setup(tmp_path_factory.mktemp("cuda"))
    return ckpt, cpu, kvs


def levels(a: np.ndarray, b: np.ndarray) -> tuple[int, float]:
    diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return int(diff.max()), float(diff.mean())


# (max, mean) levels against float32 on the CPU; bf16's max is not bounded, only its mean.
GPU_BOUNDS = {torch.float32: (2, 0.05), torch.bfloat16: (255, 1.5)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_the_gpu_matches_the_cpu(setup, dtype):
    ckpt, cpu, kvs = setup
    gpu = NeoPPPipeline.from_pretrained(ckpt, device="cuda", dtype=dtype)
    for i, req in enumerate(mixed(kvs)):
        worst, mean = levels(gpu.generate(req), cpu.generate(req))
        print(f"request {i}: {dtype} GPU vs float32 CPU max {worst} mean {mean:.4f}")
        bound_max, bound_mean = GPU_BOUNDS[dtype]
        assert worst <= bound_max and mean <= bound_mean, f"request {i}: max {worst}, mean {mean:.4f}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_step_batching_on_the_gpu_matches_solo(setup, dtype):
    """Requests batched step by step on the GPU against each one alone on the GPU."""
    ckpt, _, kvs = setup
    gpu = NeoPPPipeline.from_pretrained(ckpt, device="cuda", dtype=dtype)
    reqs = mixed(kvs)
    solo = [gpu.generate(r) for r in reqs]
    collectors = [Collector() for _ in reqs]
    engine = BatchingEngine(gpu)
    try:
        for r, c in zip(reqs, collectors):
            engine.submit(r, c.emit, lambda c=c: c.cancel)
        for c in collectors:
            assert c.done.wait(120)
    finally:
        engine.close()
    for i, (c, want) in enumerate(zip(collectors, solo)):
        worst, mean = levels(c.events[-1].final, want)
        print(f"request {i}: {dtype} batched vs solo on the GPU max {worst} mean {mean:.4f}")
        bound = 0.05 if dtype == torch.float32 else 0.5  # bf16: other GEMM shapes round differently
        assert mean <= bound, f"request {i}: max {worst}, mean {mean:.4f}"
