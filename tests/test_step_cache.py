"""Per-request step caches inside step batching, against a plainly written one-request loop.

Byte equality holds for the same reason as in test_batching: on the CPU the layers' float32 GEMMs
run in fixed row tiles, so a row's sums do not depend on which rows share the call, and the
reference below runs the same layer functions one branch at a time. Its cache decisions are
written out again, step by step, from the methods' definitions (not through the module).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from neopp.errors import InputError
from neopp.model.embeddings import patchify, unpatchify
from neopp.modes import ModeSpec, SamplingParams
from neopp.sampling.batching import StepBatcher, start, step_cost
from neopp.sampling.plan import check_cache
from neopp.sampling.sampler import to_pixels
from neopp.sampling.step_cache import DEFAULT_THRESHOLDS, MAX_REUSE, new_cache
from testing.stream_requests import assert_pixels_match, make, run_step_batch, tiny_setup

STEPS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ckpt, pipe, kvs = tiny_setup(tmp_path_factory.mktemp("step_cache"))
    return pipe, kvs


def run_batch(pipe, reqs, joins=None):
    """Finals in order and each request's cache (None: off)."""
    finals, started = run_step_batch(pipe, reqs, joins)
    return finals, [a.cache for a in started]


def rel(new, old):
    return float((new.float() - old.float()).abs().mean() / old.float().abs().mean().clamp_min(1e-12))


def reference(pipe, req, method, threshold):
    """One request, one branch at a time, the cache rules written out; (pixels, computed, reused)."""
    prep, tower, steps = pipe.prepare(req), pipe.transformer, req.sampling_params.infer_steps
    depth, t_size = len(tower.layers), prep.grid.token_size
    x = prep.sampler.start(req, pipe.device)
    z = patchify(x, t_size)
    mem, computed, reused = {}, 0, 0
    for k in range(steps):
        hid = pipe.embed(x, prep, k)
        names = pipe.step_branch_names(prep, k)
        vs = []
        for n in names:
            b, m = prep.branches[n], mem.setdefault(n, {"res": None, "probe": None, "run": 0, "at": -1,
                                                          "drift": 0.0, "slope": None})
            forced = m["res"] is None or k == steps - 1 or m["run"] >= MAX_REUSE
            if method == "fbcache":
                h1 = tower.run_layers(hid, b, range(1))
                d1 = h1.float() - hid.float()
                if not forced and rel(d1, m["probe"]) < threshold:
                    out, m["run"], reused = (h1.float() + m["res"]).to(h1.dtype), m["run"] + 1, reused + 1
                else:
                    out = tower.run_layers(h1, b, range(1, depth))
                    m.update(probe=d1, res=out.float() - h1.float(), run=0, at=k)
                    computed += 1
            else:
                if m["probe"] is not None:
                    m["drift"] += rel(hid, m["probe"])
                m["probe"] = hid
                if not forced and m["drift"] < threshold:
                    res = m["res"] if m["slope"] is None else m["res"] + (k - m["at"]) * m["slope"]
                    out, m["run"], reused = (hid.float() + res).to(hid.dtype), m["run"] + 1, reused + 1
                else:
                    out = tower.run_layers(hid, b)
                    res = out.float() - hid.float()
                    if m["res"] is not None:
                        m["slope"] = (res - m["res"]) / (k - m["at"])
                    m.update(res=res, at=k, drift=0.0, run=0)
                    computed += 1
            vs.append(pipe.head_velocity(out, z, prep, k))
        prep.sampler.step(z, pipe.combine_step(prep, k, vs, req.sampling_params), k)
        x = unpatchify(z, req.height, req.width, t_size)
    return to_pixels(x), computed, reused


def requests(kvs, cache, threshold=None):
    kw = {} if cache == "off" else {"cache": cache, "cache_threshold": threshold}
    return [make(kvs, 0, 64, 96, STEPS, 1, cfg_norm="channel", **kw),
            make(kvs, 1, 96, 64, STEPS, 2, enable_cfg=False, **kw),
            make(kvs, 2, 64, 64, STEPS, 3, cfg_interval=(0.3, 0.8), cfg_scale=3.0, **kw)]


@pytest.mark.parametrize("method,threshold", [("fbcache", 0.3), ("taylorseer", 0.3)])
def test_cached_requests_match_the_reference_alone_and_in_a_batch(setup, method, threshold):
    pipe, kvs = setup
    reqs = requests(kvs, method, threshold)
    off = requests(kvs, "off")
    alone = [run_batch(pipe, [r]) for r in reqs]
    # cached and uncached requests share steps, joining at different boundaries
    together, caches = run_batch(pipe, [*reqs, *off], {0: [0, 3], 1: [1, 4], 4: [2, 5]})
    for i, req in enumerate(reqs):
        want, computed, reused = reference(pipe, req, method, threshold)
        assert reused > 0 and computed > 0, f"request {i}: the threshold exercised no reuse ({computed}, {reused})"
        assert (caches[i].computed, caches[i].reused) == (computed, reused), f"request {i}"
        assert_pixels_match(alone[i][0][0], want, f"{method} request {i} alone")
        assert_pixels_match(together[i], want, f"{method} request {i} in a batch")
        assert_pixels_match(together[3 + i], pipe.generate(off[i]), f"uncached request {i} beside cached ones")


@pytest.mark.parametrize("method", ["fbcache", "taylorseer"])
def test_a_tiny_threshold_reuses_nothing_and_gives_the_uncached_bytes(setup, method):
    """Every step computed: the first-block split and the bookkeeping change no bit."""
    pipe, kvs = setup
    finals, caches = run_batch(pipe, requests(kvs, method, 1e-9))
    for i, req in enumerate(requests(kvs, "off")):
        assert caches[i].reused == 0
        assert_pixels_match(finals[i], pipe.generate(req), f"{method} request {i}")


def test_cache_changes_the_picture_a_little_not_a_lot(setup):
    """Negative control: reuse does change the bytes, and stays near the full computation."""
    pipe, kvs = setup
    req, off = requests(kvs, "taylorseer", 0.3)[1], requests(kvs, "off")[1]
    got, want = run_batch(pipe, [req])[0][0], pipe.generate(off)
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
    assert diff.max() > 0
    assert diff.mean() < 30  # random tiny weights: a loose bound, the demo model's figures are in bench/


def test_first_last_and_every_fourth_step_are_computed(setup):
    """A huge threshold still computes step 0, the last step and after MAX_REUSE reuses in a row."""
    pipe, kvs = setup
    req = make(kvs, 1, 64, 64, STEPS, 4, enable_cfg=False, cache="taylorseer", cache_threshold=1.0)
    _, caches = run_batch(pipe, [req])
    st = caches[0].state("cond")
    assert st.computed_at == STEPS - 1
    assert caches[0].computed == 1 + len(range(MAX_REUSE + 1, STEPS - 1, MAX_REUSE + 1)) + 1
    assert caches[0].computed + caches[0].reused == STEPS


@pytest.mark.parametrize("sampling,message", [
    ({"cache": "magcache"}, "cache: unknown method"),
    ({"cache": "fbcache", "cache_threshold": 0.0}, "cache_threshold: must be a number in (0, 1]"),
    ({"cache": "fbcache", "cache_threshold": float("nan")}, "cache_threshold: must be a number in (0, 1]"),
    ({"cache": "fbcache", "cache_threshold": 1.5}, "cache_threshold: must be a number in (0, 1]"),
    ({"cache_threshold": 0.1}, "cache_threshold: 0.1 given with cache off"),
])
def test_bad_cache_values_are_refused_by_name(sampling, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(**sampling)


def test_models_refuse_what_they_do_not_offer():
    cached = SamplingParams(cache="fbcache")
    check_cache(ModeSpec(), cached)
    check_cache(ModeSpec(), SamplingParams(infer_steps=8))  # off needs no step to spare
    with pytest.raises(InputError, match="cache: needs at least 10 steps, got 8"):
        check_cache(ModeSpec(), dataclasses.replace(cached, infer_steps=8))
    with pytest.raises(InputError, match="config parameter cache_methods does not list it"):
        check_cache(ModeSpec(name="neopp_dense_8steps", cache_methods=()), cached)
    with pytest.raises(InputError, match="Ulysses ranks"):
        check_cache(ModeSpec(seq_p_size=2), cached)


def test_the_one_request_path_refuses_a_cache_it_cannot_keep(setup):
    pipe, kvs = setup
    with pytest.raises(InputError, match="cache: 'fbcache' runs only in a step-batching engine"):
        pipe.generate(make(kvs, 0, 64, 64, STEPS, 1, cache="fbcache"))
    assert torch.is_tensor(pipe.sample(make(kvs, 0, 64, 64, 2, 1)))


def test_the_scheduler_s_cost_is_what_the_step_then_runs(setup):
    """step_cost before each step equals tokens x the branches whose layers that step ran: a branch
    that reuses (taylorseer decides before the tower) costs nothing; fbcache is charged in full."""
    pipe, kvs = setup
    for req in requests(kvs, "taylorseer", 0.3)[::2] + requests(kvs, "fbcache", 0.3)[:1]:
        a, batcher, free_steps = start(pipe, 0, req), StepBatcher(pipe), 0
        while a.k < a.total:
            cost, before = step_cost(pipe, a), a.cache.computed
            branches = len(pipe.step_branch_names(a.prep, a.k))
            batcher.step([a])
            ran = branches if a.cache.method == "fbcache" else a.cache.computed - before
            assert cost == a.prep.grid.num_tokens * ran, f"{a.cache.method} step {a.k}"
            free_steps += cost == 0
        assert free_steps > 0 or a.cache.method == "fbcache"


def test_without_a_threshold_the_method_s_documented_default_applies():
    for method, default in DEFAULT_THRESHOLDS.items():
        assert new_cache(SamplingParams(cache=method)).threshold == default
        assert new_cache(SamplingParams(cache=method, cache_threshold=0.5)).threshold == 0.5
    assert new_cache(SamplingParams()) is None
