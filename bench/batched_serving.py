"""Step batching of the plain models through Triton, against the one-at-a-time path it replaced.

    python -m bench.batched_serving [--out bench] [--quick] [--baseline-ref REF] [--skip-8b]

Two tritonservers run side by side on free loopback ports: one serves this checkout (every plain
model batches: its instances hand their requests to the mode's one engine), the other an earlier
checkout (``--baseline-ref``, checked out into a temporary git worktree) whose plain models run
one request at a time. The earlier server also serves ``neopp_dense_x2``: its ``neopp_dense`` with
two instances, each on half the cores (two copies of the weights).

For every model and concurrency, perf_analyzer sends the same requests (its ``--input-data``) to
each configuration, the order rotating from point to point so the shared machine's load hits
them alike; throughput is concurrency / mean latency. Then a mixed run (this checkout only):
256x256 and 512x512 requests alternating, 1:1, at concurrency 4, from a client of ours that
times every request, against the same 256x256 requests alone. Last, what the hop from an
instance to the engine costs a request: the same requests through the link (a socket and a memory
file, in one process) and straight into the engine, alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from bench.common import REPO, write_report
from bench.eight_b import ensure_checkpoint
from bench.perf_analyzer import model_kv_shape, perf_input_data
from bench.streaming_report import PerfPoint
from bench.streaming_serving import ensure_loaded, perf_point, requests_for
from neopp.launcher.model_states import KEEP_GOING_ARGS
from neopp.launcher.tritonserver import TritonServer
from neopp.procs import model_stubs, rss_parts
from testing.loadgen import grpc_inputs
from testing.tiny_checkpoint import random_kv

BASELINE_REF = "1f37dd9"  # the last commit whose plain models ran one request at a time
DEMO = REPO / "demo" / "checkpoints"
PREFIX = (16, 4)  # cond and uncond tokens of every request: a short prompt, as the demo's
STEPS = 25
FULL = {"concurrency": (1, 2, 4, 8), "per_slot": 4}
QUICK = {"concurrency": (1, 4), "per_slot": 2}


def worktree(ref: str, dest: Path) -> Path:
    """``ref`` checked out at ``dest`` (a detached git worktree; removed by ``drop_worktree``)."""
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(dest), ref], check=True,
                   capture_output=True)
    return dest


def drop_worktree(dest: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(dest)], capture_output=True)


def copy_model(repo: Path, source: str, name: str, edits: dict[str, str]) -> None:
    """``source``'s folder as model ``name`` with regex ``edits`` applied to its config.pbtxt."""
    shutil.copytree(repo / source, repo / name)
    config = repo / name / "config.pbtxt"
    text = re.sub(rf'^name: "{source}"$', f'name: "{name}"', config.read_text(), flags=re.MULTILINE)
    for pattern, replacement in edits.items():
        text, count = re.subn(pattern, replacement, text)
        if count != 1:
            raise RuntimeError(f"{source}/config.pbtxt changed shape: {pattern!r} matched {count} times")
    config.write_text(text)


def repositories(work: Path, baseline: Path) -> tuple[Path, Path]:
    """(this checkout's repository, the earlier one's), copies with the extra models added."""
    now = work / "now"
    shutil.copytree(REPO / "model_repository", now)
    before = work / "before"
    shutil.copytree(baseline / "model_repository", before)
    half = str(max(1, (os.cpu_count() or 2) // 2))
    copy_model(before, "neopp_dense", "neopp_dense_x2", {
        r"(instance_group \[ \{ kind: KIND_CPU) count: 1": r"\1 count: 2",
        r'(key: "num_threads" value: \{ string_value: )"\d+"': rf'\1"{half}"'})
    return now, before


def server(repo: Path, models: Sequence[str], env: dict[str, str], log: Path) -> TritonServer:
    return TritonServer(repo, env=env, log_path=log, extra_args=[
        "--model-control-mode=explicit", *KEEP_GOING_ARGS, *(f"--load-model={m}" for m in models)])


def checkpoint_env(dense: Path, moe: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEOPP_CHECKPOINT", "NEOPP_LORA_DIR"))}
    env["NEOPP_CHECKPOINT"] = str(dense)
    if moe is not None:
        env.update({f"NEOPP_CHECKPOINT_{m.upper()}": str(moe) for m in ("neopp_moe", "neopp_moe_cfg")})
    return env


def measure(configs: Sequence[tuple[str, str, str]], work: Path, size: int, steps: int,
            concurrencies: Sequence[int], per_slot: int, tag: str) -> dict[tuple[str, int], PerfPoint]:
    """{(label, concurrency): point} for ``configs`` of (label, gRPC url, model), rotating order."""
    kv_dims = model_kv_shape(configs[0][1], configs[0][2])
    data = work / f"data_{tag}.json"
    data.write_text(json.dumps(perf_input_data(kv_dims, *PREFIX, (size, size), steps, offsets=PREFIX)))
    for _label, url, model in configs:  # one warm request each
        perf_point(url, model, data, 1, 1, work / "warm.csv", False)
    rows = {}
    for turn, c in enumerate(concurrencies):
        for label, url, model in configs[turn % len(configs):] + configs[:turn % len(configs)]:
            rows[(label, c)] = perf_point(url, model, data, c, requests_for(c, per_slot),
                                          work / f"perf_{tag}_{c}.csv", False)
            print(f"  {tag} c={c} {label}: {rows[(label, c)]}", flush=True)
    return rows


def timed_requests(url: str, model: str, kv_dims: tuple[int, int, int], sizes: Sequence[int], concurrency: int,
                   count: int, steps: int) -> dict[int, list[float]]:
    """Seconds of each request by size: ``count`` requests cycling through ``sizes``, ``concurrency`` at a time."""
    layers, kv_heads, head_dim = kv_dims
    cfg = {"llm_config": {"num_hidden_layers": layers, "num_key_value_heads": kv_heads, "head_dim": head_dim}}
    cond, uncond = (random_kv(cfg, t, seed=i).float().numpy() for i, t in enumerate(PREFIX))
    jobs = list(range(count))
    lock, out = threading.Lock(), {s: [] for s in sizes}

    def worker() -> None:
        client = grpcclient.InferenceServerClient(url)
        while True:
            with lock:
                if not jobs:
                    break
                i = jobs.pop(0)
            size = sizes[i % len(sizes)]
            ints = {"INDEX_OFFSET_COND": [PREFIX[0]], "INDEX_OFFSET_UNCOND": [PREFIX[1]], "SIZE": [size, size],
                    "STEPS": [steps], "SEED": [i]}
            inputs = grpc_inputs({"COND_KV": (cond, "BF16"), "UNCOND_KV": (uncond, "BF16"),
                                  **{k: (np.array(v, np.int64), "INT64") for k, v in ints.items()}})
            start = time.perf_counter()
            client.infer(model, inputs, client_timeout=1800)
            with lock:
                out[size].append(time.perf_counter() - start)
        client.close()

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def throughput_table(rows: dict[tuple[str, int], PerfPoint], labels: Sequence[str], base: str) -> list[str]:
    concurrencies = sorted({c for _, c in rows})
    head = "| concurrency | " + " | ".join(f"{label} img/s (p50 / p99 s)" for label in labels) + \
        " | " + " | ".join(f"{label} / {base}" for label in labels if label != base) + " |"
    out = [head, "|" + "---|" * (1 + 2 * len(labels) - 1)]
    for c in concurrencies:
        cells = [f"{rows[(lb, c)].infer_s:.2f} ({rows[(lb, c)].p50_ms / 1e3:.2f} / {rows[(lb, c)].p99_ms / 1e3:.2f})"
                 for lb in labels]
        ratios = [f"{rows[(lb, c)].infer_s / rows[(base, c)].infer_s:.2f}x" for lb in labels if lb != base]
        out.append(f"| {c} | " + " | ".join(cells + ratios) + " |")
    return out


def memory(server_: TritonServer, models: Sequence[str]) -> dict[str, int]:
    """Resident bytes of each model's stubs (not of the rank processes a multi-rank stub starts)."""
    return {m: rss_parts(model_stubs(server_.process.pid, m))["total"] for m in models}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench")
    parser.add_argument("--baseline-ref", default=BASELINE_REF)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 4, fewer requests")
    parser.add_argument("--skip-8b", action="store_true", help="leave out the slice of the 8B geometry")
    args = parser.parse_args(argv)
    matrix = QUICK if args.quick else FULL
    started, load_before = time.monotonic(), os.getloadavg()
    sections: list[str] = []
    with tempfile.TemporaryDirectory(prefix="neopp_batched_bench_") as tmp:
        work = Path(tmp)
        baseline = worktree(args.baseline_ref, work / "baseline")
        try:
            sections += run_all(args, matrix, work, baseline)
        finally:
            drop_worktree(baseline)
    settings = (f"{args.steps} steps, prefixes {PREFIX[0]}+{PREFIX[1]} tokens, guided, PNG; perf_analyzer "
                f"{matrix['per_slot']} requests per concurrent slot (at least 8) per point; earlier checkout "
                f"`{args.baseline_ref}`; {os.cpu_count()} cores; load average {load_before[0]:.1f} before, "
                f"{os.getloadavg()[0]:.1f} after; {(time.monotonic() - started) / 60:.0f} minutes")
    write_report(args.out / "batched_serving.md", "Step batching through Triton: batched plain models vs one at a "
                 "time", "\n\n".join([settings, *sections]))
    return 0


def run_all(args: argparse.Namespace, matrix: dict, work: Path, baseline: Path) -> list[str]:
    now_repo, before_repo = repositories(work, baseline)
    env = {**checkpoint_env(DEMO / "dense", DEMO / "moe"), "NEOPP_BASE_DIR": str(REPO),  # the copies' mode files
           "NEOPP_ALLOW_UNTRAINED_SIZES": "true"}  # 512x512 measures speed, which the demo's training does not bound
    before_env = {**env, "PYTHONPATH": str(baseline / "backend_src"), "NEOPP_BASE_DIR": str(baseline)}
    now_models = ("neopp_dense", "neopp_moe", "neopp_dense_cfg")
    before_models = ("neopp_dense", "neopp_dense_x2", "neopp_moe", "neopp_dense_cfg")
    sections = []
    with server(now_repo, now_models, env, work / "now.log") as now, \
            server(before_repo, before_models, before_env, work / "before.log") as before:
        ensure_loaded(now.grpc_url, models=list(now_models))
        ensure_loaded(before.grpc_url, models=before_models)
        c, per = matrix["concurrency"], matrix["per_slot"]
        dense = measure([("one at a time", before.grpc_url, "neopp_dense"),
                         ("two instances", before.grpc_url, "neopp_dense_x2"),
                         ("batched", now.grpc_url, "neopp_dense")], work, 256, args.steps, c, per, "dense")
        sections.append(dense_section(dense, memory(now, ["neopp_dense"]),
                                      memory(before, ["neopp_dense", "neopp_dense_x2"])))
        for model in ("neopp_moe", "neopp_dense_cfg"):
            rows = measure([("one at a time", before.grpc_url, model), ("batched", now.grpc_url, model)], work, 256,
                           args.steps, c, per, model)
            sections.append(f"### `{model}`, demo checkpoint, 256x256\n\n" +
                            "\n".join(throughput_table(rows, ["one at a time", "batched"], "one at a time")))
        sections.append(mixed_section(now.grpc_url, args.steps, 4, 8 if args.quick else 24))
    sections.append(link_section(args.steps, 9 if args.quick else 17))
    if not args.skip_8b:
        sections.append(eight_b_section(args, matrix, work, now_repo, before_repo, baseline))
    return sections


def dense_section(rows: dict, now_mem: dict[str, int], before_mem: dict[str, int]) -> str:
    labels = ["one at a time", "two instances", "batched"]
    lines = ["### `neopp_dense`, demo checkpoint, 256x256", "", *throughput_table(rows, labels, "one at a time"), ""]
    cs = sorted({c for _, c in rows})
    top = max(c for c in cs if c <= 4)
    one = rows[("batched", 1)]
    lines += [
        f"* Concurrency {top} against 1, batched: {rows[('batched', top)].infer_s / one.infer_s:.2f}x (goal >= 1.5x).",
        f"* Concurrency 1, batched against one at a time: "
        f"{one.infer_s / rows[('one at a time', 1)].infer_s:.2f}x (goal >= 1.0x, within this machine's noise).",
        f"* Concurrency {top}, batched against two instances: "
        f"{rows[('batched', top)].infer_s / rows[('two instances', top)].infer_s:.2f}x (goal >= 1.0x).",
        f"* Stub memory (RSS, every instance): batched `neopp_dense` {now_mem['neopp_dense'] / 2**20:.0f} MiB; "
        f"earlier one instance "
        f"{before_mem['neopp_dense'] / 2**20:.0f} MiB, two instances {before_mem['neopp_dense_x2'] / 2**20:.0f} MiB.",
    ]
    return "\n".join(lines)


def mixed_section(url: str, steps: int, concurrency: int, count: int) -> str:
    kv_dims = model_kv_shape(url, "neopp_dense")
    alone = timed_requests(url, "neopp_dense", kv_dims, (256,), 1, max(4, count // 4), steps)[256]
    mixed = timed_requests(url, "neopp_dense", kv_dims, (256, 512), concurrency, count, steps)
    small, large = mixed[256], mixed[512]
    rows = [("256x256 alone", alone), ("256x256 in the mix", small), ("512x512 in the mix", large)]
    lines = [f"### Mixed sizes, `neopp_dense`, concurrency {concurrency}, 256x256 and 512x512 1:1", "",
             "| requests | n | p50 s | p99 s | mean s |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {len(v)} | {pct(v, 0.5):.2f} | {pct(v, 0.99):.2f} | {statistics.mean(v):.2f} |"
              for name, v in rows]
    lines += ["", f"* The 256x256 requests' p99 in the mix against their p99 alone: "
                  f"{pct(small, 0.99) / pct(alone, 0.99):.2f}x (goal <= 3x)."]
    return "\n".join(lines)


def eight_b_section(args: argparse.Namespace, matrix: dict, work: Path, now_repo: Path, before_repo: Path,
                    baseline: Path) -> str:
    ckpt = REPO / "build" / "bench_8b_slice"
    ensure_checkpoint(ckpt, layers=1)
    env = checkpoint_env(ckpt)
    with server(now_repo, ("neopp_dense",), env, work / "now8b.log") as now, \
            server(before_repo, ("neopp_dense",), {**env, "PYTHONPATH": str(baseline / "backend_src")},
                   work / "before8b.log") as before:
        ensure_loaded(now.grpc_url, models=["neopp_dense", "neopp_dense_stream"])
        ensure_loaded(before.grpc_url, models=["neopp_dense"])
        rows = measure([("one at a time", before.grpc_url, "neopp_dense"), ("batched", now.grpc_url, "neopp_dense")],
                       work, 256, 4, matrix["concurrency"], 2, "8b")
    return ("### `neopp_dense`, one layer of the 8B geometry (4096 wide, 8 KV heads of 128), 256x256, 4 steps\n\n" +
            "\n".join(throughput_table(rows, ["one at a time", "batched"], "one at a time")))



def link_section(steps: int, rounds: int) -> str:
    """The hop from an instance to the engine: one request through the link (socket, memory file,
    parsing in the engine's stub, pixels back) against the same request straight into the engine."""
    import torch

    from neopp.engines.batch_engine import BatchingEngine
    from neopp.engines.intra_op import on_passing_thread, single_threaded_here_on
    from neopp.modes import load_mode
    from neopp.request import GenerationRequest
    from neopp.sampling.pipeline import NeoPPPipeline
    from neopp.sampling.rng import NoiseStream
    from neopp.serving.engine_host import EngineHost
    from neopp.serving.engine_link import EngineLink
    from neopp.serving.model_settings import TritonModelSettings
    from testing.local_tensors import request_tensors

    mode = load_mode(REPO / "configs" / "neopp" / "neopp_dense.json")
    threads = torch.get_num_threads()
    engine = on_passing_thread(  # as a stub builds it: the step thread is the one with a thread team
        lambda: BatchingEngine(NeoPPPipeline.from_pretrained(DEMO / "dense", mode, "cpu", torch.float32)))
    single_threaded_here_on()
    pipe = engine.pipe
    layers, kv_heads, head_dim = pipe.config.kv_dims
    cfg = {"llm_config": {"num_hidden_layers": layers, "num_key_value_heads": kv_heads, "head_dim": head_dim}}
    req = GenerationRequest(cond_kv=random_kv(cfg, PREFIX[0], 1), uncond_kv=random_kv(cfg, PREFIX[1], 2),
                            index_offset_cond=PREFIX[0], index_offset_uncond=PREFIX[1], height=256, width=256,
                            sampling_params=mode.sampling_params.replace(infer_steps=steps, output_format="png"))
    settings = TritonModelSettings(model_name="bench", checkpoint=DEMO / "dense", mode_file=Path("-"),
                                   lora_dir=Path("-"), device_param="cpu", dtype_name="float32", num_threads=0,
                                   worker_processes=0, collective_timeout_s=60.0, default_task="t2i",
                                   limits=pipe.rules.limits)
    host = EngineHost(f"bench_link_{os.getpid()}", engine, settings, pipe.mode, threading.Event(), print)
    link = EngineLink(host.owner, "bench", "plain")
    direct, linked = [], []
    try:
        for i in range(rounds + 1):  # the first of each is a warm-up
            req.noise = NoiseStream(i).draw(256, 256)
            start = time.perf_counter()
            engine.generate(req)
            direct.append(time.perf_counter() - start)
            done = threading.Event()
            start = time.perf_counter()
            link.submit(request_tensors(req, i), None,
                        lambda h, b, done=done: h["type"] in ("final", "error") and done.set(), lambda: False, True)
            done.wait(600)
            linked.append(time.perf_counter() - start)
    finally:
        link.close()
        host.close()
        engine.close()
        torch.set_num_threads(threads)
    d, k = statistics.median(direct[1:]), statistics.median(linked[1:])
    hop = statistics.median(b - a for a, b in zip(direct[1:], linked[1:]))  # each pair back to back
    return "\n".join([
        "### The hop from an instance to the engine, demo 256x256",
        "",
        f"{rounds} requests each, alternating, in one process: straight into the engine {d * 1e3:.0f} ms (median), "
        f"through the link (socket, memory file, parsing in the engine's stub, pixels back) {k * 1e3:.0f} ms. "
        f"The median of the {rounds} pairs' differences (each pair run back to back, so the machine's drift "
        f"cancels) is {hop * 1e3:+.1f} ms: the hop costs {hop / d * 100:+.1f}% of a request (goal <= 2%).",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
