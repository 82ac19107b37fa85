"""CUDA graphs of the layers against eager on the same GPU, byte for byte (skipped without a GPU).

A graph replays the kernels eager launches, on the same shapes, so the images must be the same
bytes: dense, FP8 and grouped MoE in bf16, solo and step-batched. The attention kernel is fixed
to torch's pick on both sides (a measured pick could differ between two pipelines).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neopp.model.cuda_graphs import LayerGraphs
from neopp.model.speed import SpeedOptions
from neopp.modes import ModeSpec
from neopp.sampling.batching import StepBatcher, start
from neopp.sampling.pipeline import NeoPPPipeline
from testing.stream_requests import assert_pixels_match, make
from testing.tiny_checkpoint import write_sample_kv, write_tiny_checkpoint

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

EAGER = SpeedOptions(cuda_graphs="off", attention_kernel="default")
GRAPHS = SpeedOptions(cuda_graphs="on", attention_kernel="default")
MEASURED = SpeedOptions(cuda_graphs="auto", attention_kernel="auto")  # both opt-in speed paths
MODES = {
    "dense": ("dense", ModeSpec(name="dense")),
    "fp8": ("dense", ModeSpec(name="fp8", dit_quantized=True, dit_quant_scheme="fp8-sgl")),
    "moe": ("moe", ModeSpec(name="moe", version="moe")),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    ckpts = {v: write_tiny_checkpoint(root / v, v, seed=3) for v in ("dense", "moe")}
    kvs = {v: [write_sample_kv(root / f"{v}-kv{i}", v, cond_tokens=c, uncond_tokens=u, seed=i)
               for i, (c, u) in enumerate([(21, 5), (9, 3), (14, 7)])] for v in ckpts}
    return ckpts, kvs


def requests(kvs):
    """Guided, unguided and partly guided, long enough for graphs to be replayed many times."""
    return [make(kvs, 0, 64, 96, 6, 1, cfg_norm="channel"),
            make(kvs, 1, 96, 64, 5, 2, enable_cfg=False),
            make(kvs, 2, 64, 64, 7, 3, cfg_interval=(0.3, 0.8), cfg_scale=3.0)]


def pipelines(tiny, name):
    variant, mode = MODES[name]
    ckpt = tiny[0][variant]
    return [NeoPPPipeline.from_pretrained(ckpt, mode, "cuda", torch.bfloat16, speed=s) for s in (EAGER, GRAPHS)]


@pytest.mark.parametrize("name", list(MODES))
def test_a_graphed_image_is_the_eager_image(tiny, name):
    eager, graphed = pipelines(tiny, name)
    assert eager.layer_graphs is None and graphed.layer_graphs is not None
    if name == "moe":
        assert graphed.transformer.layers[0].mlp.grouped is not None  # the loop syncs with the host
    kvs = tiny[1][MODES[name][0]]
    for i, (a, b) in enumerate(zip(requests(kvs), requests(kvs))):
        assert_pixels_match(graphed.generate(a), eager.generate(b), f"{name} request {i}")
    graphs = graphed.layer_graphs
    print(f"{name}: {graphs.captures} captures, {graphs.replays} replays")
    assert graphs.enabled and graphs.captures >= 3 and graphs.replays >= 12
    assert not graphs.graphs and not graphs.warm  # each request's graphs left with it


def step_batched(pipe, reqs):
    """Every request admitted at once, stepped together until each is done (a fixed batch
    composition at every step, so both pipelines batch the same way)."""
    batcher, finals = StepBatcher(pipe), {}
    active = [start(pipe, i, r) for i, r in enumerate(reqs)]
    while active:
        events = batcher.step(active)
        for a, ev in zip(active, events):
            assert ev.error is None, ev.error
            if ev.final is not None:
                finals[a.job] = ev.final
                pipe.release(a.prep)
        active = [a for a, ev in zip(active, events) if ev.final is None]
    return [finals[i] for i in range(len(reqs))]


def test_step_batched_graphs_are_the_eager_batches(tiny):
    eager, graphed = pipelines(tiny, "dense")
    kvs = tiny[1]["dense"]
    for i, (got, want) in enumerate(zip(step_batched(graphed, requests(kvs)), step_batched(eager, requests(kvs)))):
        assert_pixels_match(got, want, f"batched request {i}")
    assert graphed.layer_graphs.enabled and graphed.layer_graphs.replays > 0
    assert not graphed.layer_graphs.graphs


def test_a_replay_that_differs_from_eager_turns_graphs_off():
    """The capture check: layers whose result is not a function of their input (here: noise
    drawn inside) cannot be a graph; the model says so and runs eagerly."""
    x = torch.randn(64, 32, device="cuda")

    def noisy(hid, branches):
        return hid + torch.rand_like(hid)

    graphs, owner = LayerGraphs(noisy, torch.device("cuda")), object()
    for _ in range(3):
        out = graphs(x, owner)
        assert out.shape == x.shape
    assert not graphs.enabled and graphs.captures == 0 and not graphs.graphs


def test_graphs_are_bounded_and_reused():
    weight = torch.randn(32, 32, device="cuda")
    graphs = LayerGraphs(lambda hid, branches: hid @ weight, torch.device("cuda"), limit=2)
    owners = [object() for _ in range(3)]
    for owner in owners:
        for _ in range(4):
            x = torch.randn(16, 32, device="cuda")
            torch.testing.assert_close(graphs(x, owner), x @ weight)
    assert graphs.captures == 3 and graphs.replays == 9 and len(graphs.graphs) == 2
    graphs.release(owners[1:])
    assert not graphs.graphs



def test_the_opted_in_speed_paths_keep_their_graphs(tiny):
    """Graphs with the attention kernel measured per shape (what a model runs with both set to
    auto): every request replays graphs, and the images stay within bf16 rounding of eager's. The
    default is eager: graphs are opt-in until a recorded GPU run shows them byte-equal to it."""
    variant, mode = MODES["dense"]
    ckpt, kvs = tiny[0][variant], tiny[1][variant]
    assert NeoPPPipeline.from_pretrained(tiny[0][variant], mode, "cuda", torch.bfloat16).layer_graphs is None
    served = NeoPPPipeline.from_pretrained(ckpt, mode, "cuda", torch.bfloat16, speed=MEASURED)
    eager = NeoPPPipeline.from_pretrained(ckpt, mode, "cuda", torch.bfloat16, speed=EAGER)
    assert served.layer_graphs is not None
    for i, (a, b) in enumerate(zip(requests(kvs), requests(kvs))):
        diff = np.abs(served.generate(a).astype(np.int16) - eager.generate(b).astype(np.int16))
        assert diff.mean() <= 0.5, f"request {i}: mean {diff.mean():.3f} levels"
    assert served.layer_graphs.enabled and served.layer_graphs.replays > 0
    assert served.attention.timings  # the kernels were measured


def test_a_step_that_reads_the_host_is_never_captured(tiny):
    """MoE experts run as a loop read their token counts on the host: graphs stay off (auto)."""
    mode = MODES["moe"][1]
    pipe = NeoPPPipeline.from_pretrained(tiny[0]["moe"], mode, "cuda", torch.bfloat16,
                                         speed=SpeedOptions(attention_kernel="default"))
    for layer in pipe.transformer.layers:
        layer.mlp.grouped = None  # as NEOPP_MOE_DISPATCH=loop builds it
    pipe.use_speed(SpeedOptions(attention_kernel="default"))
    assert pipe.transformer.reads_host_values and pipe.layer_graphs is None
