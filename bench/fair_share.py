"""Fair share between sizes against every request stepping every time, in one process.

    python -m bench.fair_share [--out bench] [--rounds 3] [--per-client 4]

The demo's `neopp_dense` engine, built as a stub builds it. Four clients send back to back, two of
256x256 requests and two of 512x512, guided, 25 steps. Each round runs the mix once under each
policy, the order alternating: the step loop's fair share (``fair_turn``), and "all step" (every
running request in every step, the loop before the fair share). Then 256x256 requests alone, one
at a time, for their solo latency. Printed: the 256x256 requests' p50/p99 against solo, the
512x512 ones', and the images per second of the whole mix under each policy.
"""

from __future__ import annotations

import statistics
import threading
import time
from contextlib import contextmanager

import numpy as np
import torch

from bench.common import REPO, load_note, section_main
from neopp.engines import step_loop
from neopp.engines.batch_engine import BatchingEngine
from neopp.engines.intra_op import on_passing_thread, single_threaded_here_on
from neopp.modes import load_mode
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing.tiny_checkpoint import random_kv

DEMO = REPO / "demo" / "checkpoints" / "dense"
PREFIX = (16, 4)
SMALL, LARGE = 256, 512


@contextmanager
def every_request_steps():
    """The loop without the fair share: every running request takes every step."""
    fair = step_loop.fair_turn
    step_loop.fair_turn = lambda active, cost: list(active)
    try:
        yield
    finally:
        step_loop.fair_turn = fair


def requester(engine: BatchingEngine, cfg: dict, steps: int):
    def request(size: int, seed: int) -> GenerationRequest:
        return GenerationRequest(cond_kv=random_kv(cfg, PREFIX[0], 1), uncond_kv=random_kv(cfg, PREFIX[1], 2),
                                 index_offset_cond=PREFIX[0], index_offset_uncond=PREFIX[1], height=size,
                                 width=size, noise=NoiseStream(seed).draw(size, size),
                                 sampling_params=engine.pipe.mode.sampling_params.replace(infer_steps=steps))
    return request


def mix(engine: BatchingEngine, request, per_client: int) -> tuple[dict[int, list[float]], float]:
    """Seconds of every request by size, and the wall time of the whole mix."""
    lock, out = threading.Lock(), {SMALL: [], LARGE: []}

    def client(size: int, seed: int) -> None:
        for i in range(per_client):
            req = request(size, seed * 100 + i)
            began = time.perf_counter()
            engine.generate(req)
            with lock:
                out[size].append(time.perf_counter() - began)

    clients = [threading.Thread(target=client, args=(size, n)) for n, size in enumerate((SMALL, LARGE, SMALL, LARGE))]
    began = time.perf_counter()
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    return out, time.perf_counter() - began


def p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def body(args) -> str:
    mode = load_mode(REPO / "configs" / "neopp" / "neopp_dense.json")
    engine = on_passing_thread(lambda: BatchingEngine(NeoPPPipeline.from_pretrained(DEMO, mode, "cpu", torch.float32)))
    single_threaded_here_on()
    layers, kv_heads, head_dim = engine.config.kv_dims
    cfg = {"llm_config": {"num_hidden_layers": layers, "num_key_value_heads": kv_heads, "head_dim": head_dim}}
    request = requester(engine, cfg, args.steps)
    try:
        engine.generate(request(SMALL, 0))  # warm
        results = {"fair share": ({SMALL: [], LARGE: []}, []), "all step": ({SMALL: [], LARGE: []}, [])}
        for r in range(args.rounds):
            order = ["fair share", "all step"] if r % 2 == 0 else ["all step", "fair share"]
            for policy in order:
                if policy == "all step":
                    with every_request_steps():
                        seconds, wall = mix(engine, request, args.per_client)
                else:
                    seconds, wall = mix(engine, request, args.per_client)
                for size in (SMALL, LARGE):
                    results[policy][0][size] += seconds[size]
                results[policy][1].append(wall)
        solo = []
        for i in range(2 * args.per_client):
            began = time.perf_counter()
            engine.generate(request(SMALL, 1000 + i))
            solo.append(time.perf_counter() - began)
    finally:
        engine.close()
    images = 4 * args.per_client
    lines = [f"Demo checkpoint, guided, {args.steps} steps, prefixes {PREFIX[0]}+{PREFIX[1]} tokens; 4 clients back to "
             f"back (two of {SMALL}x{SMALL}, two of {LARGE}x{LARGE}), {args.per_client} requests each; "
             f"{args.rounds} rounds, the policies alternating; the engine's step thread on "
             f"{engine.threads} threads.", "",
             f"{SMALL}x{SMALL} alone, one at a time: p50 {p(solo, 50):.2f} s, p99 {p(solo, 99):.2f} s.", "",
             "| policy | 256x256 p50 / p99 s | 256 p99 / solo p99 | 512x512 p50 / p99 s | mix images/s |",
             "|---|---|---|---|---|"]
    rate = {}
    for policy, (seconds, walls) in results.items():
        small, large = seconds[SMALL], seconds[LARGE]
        rate[policy] = images / statistics.median(walls)
        lines.append(f"| {policy} | {p(small, 50):.2f} / {p(small, 99):.2f} | {p(small, 99) / p(solo, 99):.2f}x | "
                     f"{p(large, 50):.2f} / {p(large, 99):.2f} | {rate[policy]:.2f} |")
    lines += ["", f"* Mix throughput, fair share against all step: {rate['fair share'] / rate['all step']:.3f}x "
              "(goal: within 5%).", "", load_note()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    section_main(argv, __doc__, "fair_share.md", "Fair share between sizes: small requests beside large ones", body,
                 rounds=3, per_client=4, steps=25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
