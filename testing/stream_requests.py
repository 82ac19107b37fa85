"""Requests and event collectors shared by the streaming-engine tests.

Pixels are compared byte for byte: on the CPU the layers' GEMMs run in fixed row tiles
(`NEOPP_ROW_TILE`, `neopp.model.kernel_choices`), so a request's rows give the same float32 bytes whichever other
requests share the step.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import numpy as np
import torch

from neopp.model.kv_cache import load_kv_file
from neopp.modes import SamplingParams
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing.tiny_checkpoint import write_sample_kv, write_tiny_checkpoint


def tiny_setup(root: Path) -> tuple[Path, NeoPPPipeline, list[dict[str, Path]]]:
    """A tiny dense checkpoint, its float32 pipeline and three prefixes of different lengths."""
    ckpt = write_tiny_checkpoint(root / "dense", "dense", seed=3)
    kvs = [write_sample_kv(root / f"kv{i}", "dense", cond_tokens=c, uncond_tokens=u, seed=i)
           for i, (c, u) in enumerate([(21, 5), (9, 3), (14, 7)])]
    return ckpt, NeoPPPipeline.from_pretrained(ckpt, device="cpu", dtype=torch.float32), kvs


def assert_pixels_match(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    """The same bytes (see the module docstring); the message says by how much they differ."""
    assert got.shape == want.shape, what
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
    assert diff.max() == 0, f"{what}: max {diff.max()}, {(diff > 0).mean():.4%} of the values differ"


def assert_pixels_near(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    """float32 against the float64 reference: a value on a rounding boundary may flip one level."""
    assert got.shape == want.shape, what
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, f"{what}: max {diff.max()}, {(diff > 0).mean():.2%} differ"


def make(kvs, i: int, height: int, width: int, steps: int, seed: int, **sampling) -> GenerationRequest:
    kv = kvs[i]
    return GenerationRequest(cond_kv=load_kv_file(kv["cond_pt"]), uncond_kv=load_kv_file(kv["uncond_pt"]),
                             index_offset_cond=30 + i, index_offset_uncond=4 + i, height=height, width=width,
                             noise=NoiseStream(seed).draw(height, width),
                             sampling_params=SamplingParams(infer_steps=steps, **sampling))


def mixed(kvs) -> list[GenerationRequest]:
    """Different sizes, step counts, prefixes; guided, unguided and partly guided."""
    return [make(kvs, 0, 64, 96, 3, 1, cfg_norm="channel"),
            make(kvs, 1, 96, 64, 2, 2, enable_cfg=False),
            make(kvs, 2, 64, 64, 4, 3, cfg_interval=(0.3, 0.8), cfg_scale=3.0)]


class Collector:
    """Events of one request, and a cancel switch the test flips from ``emit``. ``first_at``: the
    order in which the collectors got their first event (a counter shared by every collector)."""

    _order = itertools.count()

    def __init__(self, cancel_after: int | None = None) -> None:
        self.events, self.done, self.first = [], threading.Event(), threading.Event()
        self.cancel_after, self.cancel = cancel_after, False
        self.first_at: int | None = None

    def emit(self, ev) -> None:
        if self.first_at is None:
            self.first_at = next(Collector._order)
            self.first.set()
        self.events.append(ev)
        if self.cancel_after is not None and ev.step >= self.cancel_after:
            self.cancel = True
        if ev.last:
            self.done.set()


def run_step_batch(pipe: NeoPPPipeline, reqs: list[GenerationRequest],
                   joins: dict[int, list[int]] | None = None) -> tuple[list[np.ndarray], list]:
    """Every request through one StepBatcher, each joining at its step boundary in ``joins``
    (default: all at once); their finals in order, and their running state (``Active``)."""
    from neopp.sampling.batching import StepBatcher, start

    joins = joins or {0: list(range(len(reqs)))}
    batcher, active, finals, started, boundary = StepBatcher(pipe), [], {}, {}, 0
    while active or any(b >= boundary for b in joins):
        for i in joins.get(boundary, []):
            started[i] = start(pipe, i, reqs[i])
            active.append(started[i])
        events = batcher.step(active)
        for a, ev in zip(active, events):
            assert ev.error is None, ev.error
            if ev.final is not None:
                finals[a.job] = ev.final
        active = [a for a, ev in zip(active, events) if not ev.last]
        boundary += 1
    return [finals[i] for i in range(len(reqs))], [started[i] for i in range(len(reqs))]
