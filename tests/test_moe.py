"""MoE layer (router, top-k, grouped expert dispatch) against a plainly written per-token loop."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from neopp.errors import ConfigError
from neopp.model.layers import Linear, MoE, SwiGLU
from neopp.modes import ModeSpec, SamplingParams
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing.probes import branch_velocity
from testing.tiny_checkpoint import random_kv, tiny_config, write_tiny_checkpoint
from tests.reference import neopp_reference as ref

D, FF, E = 32, 48, 6


def make_moe(top_k: int, norm_topk_prob: bool, seed: int = 0, starve: int | None = None) -> MoE:
    """Random experts; with `starve`, that expert's router row points away from every token."""
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(E, D, generator=gen)
    if starve is not None:
        router[:, 0] = 3.0
        router[starve, 0] = -30.0  # tokens carry x[:, 0] = 4 (see tokens()), so this logit is far below
    experts = [SwiGLU(*(Linear(torch.randn(o, i, generator=gen) / i ** 0.5) for o, i in ((FF, D), (FF, D), (D, FF))))
               for _ in range(E)]
    return MoE(Linear(router), experts, top_k, norm_topk_prob)


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(n, D, generator=torch.Generator().manual_seed(seed))
    x[:, 0] = 4.0
    return x


def per_token_reference(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, list[set[int]]]:
    """float64, one token at a time, written out plainly: logits, top-k, softmax, weighted SwiGLUs."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    chosen = []
    for n in range(x.shape[0]):
        xn = x[n].double()
        logits = [float(xn @ moe.router.weight[e].double()) for e in range(E)]
        if moe.norm_topk_prob:
            ids = sorted(range(E), key=lambda e: -logits[e])[: moe.top_k]
            exps = [math.exp(logits[e] - max(logits[i] for i in ids)) for e in ids]
            weights = [v / sum(exps) for v in exps]
        else:
            exps = [math.exp(v - max(logits)) for v in logits]
            probs = [v / sum(exps) for v in exps]
            ids = sorted(range(E), key=lambda e: -probs[e])[: moe.top_k]
            weights = [probs[e] for e in ids]
        chosen.append(set(ids))
        for wgt, e in zip(weights, ids):
            ex = moe.experts[e]
            g, u = xn @ ex.gate.weight.double().T, xn @ ex.up.weight.double().T
            out[n] += wgt * ((g * torch.sigmoid(g) * u) @ ex.down.weight.double().T)
    return out, chosen


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("top_k,n_tokens", [(2, 9), (1, 5), (3, 1), (E, 4)])
def test_moe_matches_per_token_reference(norm_topk_prob, top_k, n_tokens):
    moe = make_moe(top_k, norm_topk_prob, seed=top_k)
    x = tokens(n_tokens, seed=n_tokens)
    want, _ = per_token_reference(moe, x)
    torch.testing.assert_close(moe(x).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_expert_with_no_token(norm_topk_prob):
    moe = make_moe(2, norm_topk_prob, seed=3, starve=4)
    x = tokens(12, seed=7)
    want, chosen = per_token_reference(moe, x)
    used = set().union(*chosen)
    assert 4 not in used and len(used) >= 3  # the starved expert gets nothing; others share the tokens
    _, ids = moe.route(x)
    assert not (ids == 4).any()
    torch.testing.assert_close(moe(x).double(), want, rtol=1e-5, atol=1e-5)


def test_routing_weights_by_hand():
    """Two experts' logits 1 and 0 among four: the two settings give different weights."""
    router = torch.zeros(4, D)
    router[0, 0], router[1, 0], router[2, 0], router[3, 0] = 1.0, 0.0, -1.0, -2.0
    x = torch.zeros(1, D)
    x[0, 0] = 1.0
    experts = [SwiGLU(Linear(torch.zeros(FF, D)), Linear(torch.zeros(FF, D)), Linear(torch.zeros(D, FF)))] * 4
    w_norm, ids = MoE(Linear(router), experts, 2, True).route(x)
    assert ids.tolist() == [[0, 1]]
    e = math.e
    assert w_norm[0].tolist() == pytest.approx([e / (e + 1), 1 / (e + 1)], rel=1e-6)
    w_all, ids = MoE(Linear(router), experts, 2, False).route(x)
    total = e + 1 + 1 / e + 1 / e ** 2
    assert ids.tolist() == [[0, 1]]
    assert w_all[0].tolist() == pytest.approx([e / total, 1 / total], rel=1e-6)


def test_each_expert_runs_once_over_its_tokens():
    """Grouped dispatch: an expert's matmul sees exactly the tokens routed to it, in one call."""
    moe = make_moe(2, True, seed=5, starve=1)
    calls: dict[int, list[int]] = {}
    for j, expert in enumerate(moe.experts):
        orig = expert.gate

        def spy(x, j=j, orig=orig):
            calls.setdefault(j, []).append(x.shape[0])
            return orig(x)
        expert.gate = spy
    x = tokens(16, seed=2)
    _, ids = moe.route(x)
    moe(x)
    counts = torch.bincount(ids.reshape(-1), minlength=E).tolist()
    assert calls == {j: [c] for j, c in enumerate(counts) if c}
    assert 1 not in calls


@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    a = write_tiny_checkpoint(root / "topk_norm", "moe")
    b = write_tiny_checkpoint(root / "softmax_all", "moe")
    raw = json.loads((b / "config.json").read_text())
    raw["llm_config"]["norm_topk_prob"] = False
    (b / "config.json").write_text(json.dumps(raw))
    return {True: a, False: b}


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_tower_velocity_against_float64_reference(moe_ckpts, norm_topk_prob):
    mode = ModeSpec(name="moe", version="moe", sampling_params=SamplingParams(infer_steps=2))
    pipe = NeoPPPipeline.from_pretrained(moe_ckpts[norm_topk_prob], mode, "cpu", torch.float32)
    assert pipe.config.norm_topk_prob is norm_topk_prob
    cfg = tiny_config("moe")
    req = GenerationRequest(cond_kv=random_kv(cfg, 9, 5), index_offset_cond=10, height=64, width=96,
                            noise=NoiseStream(8).draw(64, 96))
    got = branch_velocity(pipe, req, req.noise, 0.3).double()
    want = ref.reference_velocity(moe_ckpts[norm_topk_prob], req.cond_kv, 10, req.noise, 0.3, 64, 96)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_moe_dispatch_agrees_with_dense_loop_in_bf16():
    """In bf16 the grouped dispatch stays within bf16 rounding of the float32 result."""
    moe = make_moe(2, True, seed=9)
    x = tokens(64, seed=4)
    want = moe(x)
    bf = MoE(Linear(moe.router.weight.bfloat16()),
             [SwiGLU(*(Linear(lin.weight.bfloat16()) for lin in e.linears())) for e in moe.experts], 2, True)
    got = bf(x.bfloat16()).float()
    assert ((got - want).norm() / want.norm()).item() < 0.02
    assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.999


def copy_moe(moe: MoE, dispatch: str) -> MoE:
    experts = [SwiGLU(*(Linear(lin.weight.clone()) for lin in e.linears())) for e in moe.experts]
    return MoE(Linear(moe.router.weight), experts, moe.top_k, moe.norm_topk_prob, dispatch=dispatch)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("top_k,n_tokens,starve", [(2, 9, None), (1, 5, 3), (3, 1, None), (E, 300, None),
                                                    (2, 200, 0)])
def test_grouped_dispatch_equals_the_loop(norm_topk_prob, top_k, n_tokens, starve):
    """One grouped product per projection over the tokens sorted by expert (no count reaches the
    host) gives the loop's result, experts without a token included."""
    loop = make_moe(top_k, norm_topk_prob, seed=5, starve=starve)
    grouped = copy_moe(loop, "grouped")
    assert loop.grouped is None and grouped.grouped is not None
    x = tokens(n_tokens, seed=2)
    torch.testing.assert_close(grouped(x), loop(x), rtol=1e-6, atol=1e-6)
    want, _ = per_token_reference(loop, x)
    torch.testing.assert_close(grouped(x).double(), want, rtol=1e-4, atol=1e-5)


def test_grouped_experts_hold_their_weights_once_and_fp8_experts_keep_the_loop():
    moe = copy_moe(make_moe(2, True), "grouped")
    for stack, name in zip(moe.grouped.stacks, ("gate", "up", "down")):
        for j, e in enumerate(moe.experts):
            assert getattr(e, name).weight.data_ptr() == stack[j].data_ptr()

    class Scaled(Linear):  # any linear of another kind (FP8 experts) is run by the loop
        pass

    odd = make_moe(2, True)
    odd.experts[0].gate = Scaled(odd.experts[0].gate.weight)
    assert MoE(odd.router, odd.experts, 2, True, dispatch="grouped").grouped is None
    with pytest.raises(ConfigError, match="NEOPP_MOE_DISPATCH"):
        MoE(odd.router, odd.experts, 2, True, dispatch="fast")


def test_a_moe_tower_draws_the_same_image_grouped(moe_ckpts, monkeypatch):
    import neopp.model.layers as layers
    from neopp.model.kernel_choices import KernelChoices

    images = {}
    for dispatch in ("loop", "grouped"):
        monkeypatch.setattr(layers, "kernel_choices", lambda d=dispatch: KernelChoices(moe_dispatch=d))
        pipe = NeoPPPipeline.from_pretrained(moe_ckpts[True], ModeSpec(version="moe"), "cpu", torch.float32)
        assert (pipe.transformer.layers[0].mlp.grouped is None) == (dispatch == "loop")
        cfg = tiny_config("moe")
        req = GenerationRequest(cond_kv=random_kv(cfg, 7, 1), uncond_kv=random_kv(cfg, 3, 2), index_offset_cond=7,
                                index_offset_uncond=3, height=64, width=64, noise=NoiseStream(4).draw(64, 64),
                                sampling_params=SamplingParams(infer_steps=3))
        images[dispatch] = pipe.sample(req)
    torch.testing.assert_close(images["grouped"], images["loop"], rtol=1e-5, atol=1e-5)
