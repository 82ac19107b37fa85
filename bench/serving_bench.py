"""Triton end to end vs the in-process runner, and throughput per instance count.

    python -m bench.serving_bench [--out bench] [--size 256] [--steps 8] [--rounds 7]

(a) One seeded request (CFG off, PNG) is timed three ways, interleaved round by round so the
shared machine's load hits all of them alike: ``NeoPPPipeline`` called in this process
(validate, generate, encode: the model's own work), Triton over gRPC with the KV bytes in the
request, and Triton with the KV in system shared memory, both through
``client_examples/lightllm_client.py`` as a new turn each time (``set_kvcache`` + ``generate``);
a fourth path is the same client with tritonclient building the gRPC request (``splice_kv=False``,
what the client did before this benchmark found that three client-side copies of the KV cost
more than everything the server does with it).
Two prefixes: a small one and the real model's (36 x 2 x 300 x 8 x 128 bf16, 44 MB), on a
checkpoint with that KV geometry and tiny widths (kv_ingest's helper). Triton's statistics and
the model's log split each request into client + wire, Triton core, Python-backend transfer
and the model's work, so a missed target says where the time went.
(b) perf_analyzer on ``neopp_dense`` with 1 and 2 instances (a ``load_model`` config override;
the committed config.pbtxt stays as it is) at concurrency 1, 2 and 4.
"""

from __future__ import annotations

import argparse
import base64
import csv
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import tritonclient.grpc as grpcclient

from bench.common import REPO, save_figure, stats, write_report
from bench.kv_ingest import lightllm_client_class, write_geometry_checkpoint
from bench.perf_analyzer import perf_input_data, run_perf_analyzer
from neopp.image_io import encode_image
from neopp.launcher.tritonserver import TritonServer
from neopp.modes import load_mode
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing.pictures import same_pixels
from testing.tiny_checkpoint import random_kv

MODEL = "neopp_dense"
PATHS = ("in-process", "Triton gRPC", "Triton shared memory", "Triton gRPC, tritonclient-built request")
TARGETS = {"Triton shared memory": 1.05, "Triton gRPC": 1.15}  # Triton / in-process, realistic KV
SEED = 1
E2E_LINE = re.compile(r"e2e_time_ms=(\d+)")
# Triton's per-request parts; the model's own time is taken out of compute_infer.
STAT_KEYS = ("success", "queue", "compute_input", "compute_infer", "compute_output")


class ServerProbe:
    """Per-request deltas of Triton's statistics plus the model's own end-to-end log time."""

    def __init__(self, server: TritonServer, client: grpcclient.InferenceServerClient) -> None:
        self.server, self.client = server, client
        self._stats = self._read_stats()
        self._lines = self._model_times()

    def _read_stats(self) -> dict[str, int]:
        model = self.client.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
        out = {k: int(model["inference_stats"].get(k, {}).get("ns", 0)) for k in STAT_KEYS}
        out["count"] = int(model["inference_stats"].get("success", {}).get("count", 0))
        return out

    def _model_times(self) -> list[float]:
        text = self.server.log_path.read_text(errors="replace") if self.server.log_path else ""
        return [float(m) / 1e3 for m in E2E_LINE.findall(text)]

    def delta(self) -> dict[str, float]:
        """Seconds of each part since the last call (the model time: its newest log line)."""
        now, lines = self._read_stats(), self._model_times()
        for _ in range(100):  # statistics and log line land a moment after the response (bounded wait)
            if len(lines) > len(self._lines) and now["count"] > self._stats["count"]:
                break
            time.sleep(0.01)
            now, lines = self._read_stats(), self._model_times()
        out = {k: (now[k] - self._stats[k]) / 1e9 for k in STAT_KEYS}
        out["model"] = lines[-1] if len(lines) > len(self._lines) else float("nan")
        self._stats, self._lines = now, lines
        return out


def server_threads(server: TritonServer) -> int:
    """torch threads of the model instance, from its load line (so in-process uses the same)."""
    found = re.findall(r"threads=(\d+)", server.log_path.read_text(errors="replace"))
    return int(found[-1]) if found else torch.get_num_threads()


def inprocess_request(pipe: NeoPPPipeline, kv: torch.Tensor, size: int, steps: int) -> Callable[[], bytes]:
    """What the model does with a parsed request, called directly: validate, generate, encode."""
    sampling = pipe.mode.sampling_params.replace(infer_steps=steps, cfg_scale=1.0, output_format="png")

    def run() -> bytes:
        req = GenerationRequest(cond_kv=kv, index_offset_cond=kv.shape[2], height=size, width=size,
                                noise=NoiseStream(SEED).draw(size, size), sampling_params=sampling)
        pipe.validate(req)
        return encode_image(pipe.generate(req), "png")

    return run


def triton_request(client, kv: torch.Tensor, size: int, steps: int) -> Callable[[], bytes]:
    """A new turn through the LightLLM client: hand over the KV and the turn's values, then one image."""
    def run() -> bytes:
        client.set_kvcache(kv)
        client.set_inference_params(kv.shape[2], cfg_scale=1.0, infer_steps=steps, output_format="png")
        return base64.b64decode(client.generate(seed=SEED, target_shape=[size, size]))

    return run


def measure_latency(server: TritonServer, pipe: NeoPPPipeline, kvs: dict[str, torch.Tensor], size: int,
                    steps: int, rounds: int) -> tuple[dict, dict]:
    """{(kv label, path): [seconds]} and {(kv label, path): [breakdown dicts]}, interleaved by round."""
    client_cls = lightllm_client_class()
    times: dict[tuple[str, str], list[float]] = {}
    parts: dict[tuple[str, str], list[dict]] = {}
    with client_cls(server.grpc_url, stateless=True, shared_memory=False) as wire, \
            client_cls(server.grpc_url, stateless=True, shared_memory=True) as shm, \
            client_cls(server.grpc_url, stateless=True, shared_memory=False, splice_kv=False) as old:
        probe = ServerProbe(server, wire.client)
        calls: dict[tuple[str, str], Callable[[], bytes]] = {}
        for label, kv in kvs.items():
            calls[(label, PATHS[0])] = inprocess_request(pipe, kv, size, steps)
            calls[(label, PATHS[1])] = triton_request(wire, kv, size, steps)
            calls[(label, PATHS[2])] = triton_request(shm, kv, size, steps)
            calls[(label, PATHS[3])] = triton_request(old, kv, size, steps)
        images = {key: fn() for key, fn in calls.items()}  # warm-up, and the same-bytes check
        # the served files are one another's bytes; the in-process one (no record) has their pixels
        same = all(images[(label, p)] == images[(label, PATHS[1])] for label in kvs for p in PATHS[2:]) and \
            all(same_pixels(images[(label, PATHS[0])], images[(label, PATHS[1])]) for label in kvs)
        probe.delta()
        for _ in range(rounds):
            for key, fn in calls.items():
                start = time.perf_counter()
                fn()
                times.setdefault(key, []).append(time.perf_counter() - start)
                if key[1] != PATHS[0]:
                    parts.setdefault(key, []).append({"total": times[key][-1], **probe.delta()})
    return {"times": times, "same_bytes": same}, parts


def breakdown_row(label: str, samples: list[dict]) -> str:
    """Median ms of: client + wire, Triton core, Python-backend transfer, the model's work."""
    def med(fn: Callable[[dict], float]) -> float:
        return stats([fn(s) for s in samples])[0] * 1e3

    client = med(lambda s: s["total"] - s["success"])
    core = med(lambda s: s["queue"] + s["compute_input"] + s["compute_output"])
    backend = med(lambda s: s["compute_infer"] - s["model"])
    return f"| {label} | {med(lambda s: s['total']):.1f} | {client:.1f} | {core:.1f} | {backend:.1f} | " \
           f"{med(lambda s: s['model']):.1f} |"


def latency_section(result: dict, parts: dict, kv_mb: dict[str, float], size: int, steps: int,
                    rounds: int, threads: int) -> tuple[str, dict]:
    """Markdown tables for (a) and the ratios Triton / in-process."""
    times = result["times"]
    lines = [f"Request: {size}x{size}, {steps} steps, CFG off (cond prefix only), seed {SEED}, PNG; offset = "
             f"prefix length. {rounds} rounds after one warm-up, paths interleaved in each round; in-process and "
             f"the model instance both run torch with {threads} threads, one process each. Same picture "
             f"from every path (the served PNG bytes alike, the in-process pixels theirs): "
             f"**{'yes' if result['same_bytes'] else 'NO'}**.", "",
             "| KV | path | median ms | min | max | Triton / in-process (of medians) | same, paired by round |",
             "|---|---|---|---|---|---|---|"]
    ratios: dict[tuple[str, str], float] = {}
    for (label, path), values in times.items():
        med, lo, hi = stats(values)
        base = times[(label, PATHS[0])]
        ratio = med / stats(base)[0]
        paired = stats([t / b for t, b in zip(values, base)])[0]
        ratios[(label, path)] = ratio
        shown = "- | -" if path == PATHS[0] else f"**{ratio:.3f}** | {paired:.3f}"
        lines.append(f"| {label} ({kv_mb[label]:.1f} MB) | {path} | {med * 1e3:.1f} | {lo * 1e3:.1f} | "
                     f"{hi * 1e3:.1f} | {shown} |")
    realistic = list(kv_mb)[-1]
    lines += ["", "Targets at the realistic KV:"]
    for path, limit in TARGETS.items():  # the client as shipped; the tritonclient-built row is the before
        r = ratios[(realistic, path)]
        lines.append(f"* {path}: {r:.3f} (target <= {limit:.2f}): **{'met' if r <= limit else 'missed'}**")
    lines += ["", "Where a Triton request's time goes (median ms): client + wire = client total - Triton's "
              "success time; Triton core = queue + compute_input + compute_output; Python-backend transfer = "
              "compute_infer - the model's own end-to-end time (its log line, whole ms: moving inputs into "
              "the stub and the response out); model = parse, validate, generate, encode in the stub.", "",
              "| KV, path | total | client + wire | Triton core | Python-backend transfer | model |",
              "|---|---|---|---|---|---|"]
    for (label, path), samples in parts.items():
        lines.append(breakdown_row(f"{label}, {path}", samples))
    lines += ["", "The gRPC rows differ only on the client: tritonclient 2.51 copies the KV three times to build "
              "a request (`tobytes`, into the protobuf message, serialization); the LightLLM client now "
              "serializes the request without the KV and appends the KV bytes as `raw_input_contents` "
              "entries (one copy). The server side (Triton core, Python backend, model) is the same on every "
              "path, and its own time matches in-process; what remains on gRPC is the transport of the bytes "
              "and Triton's gRPC front end parsing them.", "",
              "In-process for comparison: " + ", ".join(
        f"{label} {stats(times[(label, PATHS[0])])[0] * 1e3:.1f} ms" for label in kv_mb) + "."]
    return "\n".join(lines), ratios


def plot_latency(times: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(k[0] for k in times))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(PATHS)
    for i, p in enumerate(PATHS):
        meds = [stats(times[(lab, p)]) for lab in labels]
        xs = [j + i * width for j in range(len(labels))]
        ax.bar(xs, [m[0] * 1e3 for m in meds], width, label=p,
               yerr=[[(m[0] - m[1]) * 1e3 for m in meds], [(m[2] - m[0]) * 1e3 for m in meds]], capsize=3)
    ax.set_xticks([j + width * (len(PATHS) - 1) / 2 for j in range(len(labels))], labels)
    ax.set(ylabel="ms per request (median, min-max)", title="NeoPP request latency: Triton vs in-process")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    save_figure(fig, path)


# ---------------------------------------------------------------- (b) throughput


def set_instances(client: grpcclient.InferenceServerClient, count: int, threads: int) -> None:
    """Reload the model with ``count`` KIND_CPU instances of ``threads`` torch threads (0: torch's default)
    through a config override: nothing on disk changes."""
    config = client.get_model_config(MODEL, as_json=True)["config"]
    for group in config.get("instance_group", []):
        group["count"] = count
    config.setdefault("parameters", {})["num_threads"] = {"string_value": str(threads)}
    client.load_model(MODEL, config=json.dumps(config))
    deadline = time.monotonic() + 300
    while not client.is_model_ready(MODEL) and time.monotonic() < deadline:
        time.sleep(0.5)
    got = client.get_model_config(MODEL, as_json=True)["config"]["instance_group"][0]["count"]
    if int(got) != count:
        raise RuntimeError(f"{MODEL} reloaded with {got} instances, not {count}")


def perf_point(url: str, data: Path, concurrency: int, requests: int, csv_path: Path) -> dict[str, float]:
    """Exactly ``requests`` requests at ``concurrency`` (one generation outlasts any short time window, and
    the shared machine's load defeats perf_analyzer's stability check); throughput and percentiles in ms."""
    args = ["-m", MODEL, "-i", "grpc", "-u", url, "--input-data", str(data),
            "--concurrency-range", str(concurrency), "--request-count", str(requests), "-f", str(csv_path)]
    code = run_perf_analyzer(args, timeout=900)
    if code != 0 or not csv_path.exists():
        raise RuntimeError(f"perf_analyzer exited {code} for concurrency {concurrency}")
    with csv_path.open() as f:
        row = next(csv.DictReader(f))
    out = {"infer/s": float(row["Inferences/Second"])}
    for p in ("p50", "p90", "p95", "p99"):
        out[p] = float(row[f"{p} latency"]) / 1e3
    return out


def parse_spec(spec: str) -> tuple[int, int]:
    """``"2"`` -> 2 instances with the default threads; ``"2:1"`` -> 2 instances of 1 thread each."""
    count, _, threads = spec.partition(":")
    return int(count), int(threads or 0)


def spec_label(spec: str, default_threads: int) -> str:
    count, threads = parse_spec(spec)
    return f"{count} x {threads or default_threads} threads"


def measure_throughput(server: TritonServer, work: Path, kv: torch.Tensor, size: int, steps: int,
                       specs: Sequence[str], concurrencies: Sequence[int], requests: int) -> dict:
    """{(instance spec, concurrency): perf_analyzer figures}; instance counts via config override."""
    layers, _, tokens, kv_heads, head_dim = kv.shape
    data = work / "perf_data.json"
    data.write_text(json.dumps(perf_input_data((layers, kv_heads, head_dim), tokens, None, (size, size), steps,
                                               seed=SEED, offsets=(tokens, 0))))
    client = grpcclient.InferenceServerClient(server.grpc_url)
    rows = {}
    try:
        for spec in specs:
            count, threads = parse_spec(spec)
            set_instances(client, count, threads)
            perf_point(server.grpc_url, data, count, 2 * count, work / "warmup.csv")  # all instances warm
            for c in concurrencies:
                rows[(spec, c)] = perf_point(server.grpc_url, data, c, requests, work / f"perf_{spec}_{c}.csv")
                print(f"  instances {spec}, concurrency {c}: {rows[(spec, c)]}", flush=True)
    finally:
        client.close()
    return rows


def throughput_section(rows: dict, requests: int, threads: int) -> str:
    base = next(iter(rows))[0]
    lines = [f"perf_analyzer over gRPC (realistic KV in the request, same size and steps as (a)), "
             f"`--request-count {requests}` per point after a discarded warm-up of 2 requests per instance; "
             f"latency in ms (with {requests} requests, p99 is about the maximum). Instances and their torch "
             "threads come from a `load_model` config override (`instance_group.count`, parameter "
             f"`num_threads`); all else is the committed config. {threads} threads is torch's default here "
             "(one per core), so 2 instances of it oversubscribe the cores; the 1-thread row splits them.", "",
             "| instances x threads | concurrency | images/s | p50 | p90 | p95 | p99 | "
             f"vs {spec_label(base, threads)} |",
             "|---|---|---|---|---|---|---|---|"]
    for (spec, c), r in rows.items():
        ref = rows.get((base, c))
        gain = f"{r['infer/s'] / ref['infer/s']:.2f}x" if ref else "-"
        lines.append(f"| {spec_label(spec, threads)} | {c} | {r['infer/s']:.2f} | {r['p50']:.0f} | {r['p90']:.0f} | "
                     f"{r['p95']:.0f} | {r['p99']:.0f} | {gain} |")
    (spec, c), best = max(rows.items(), key=lambda kv: kv[1]["infer/s"])
    lines += ["", f"Highest throughput: {best['infer/s']:.2f} images/s ({spec_label(spec, threads)}, concurrency {c}). "
              "A CPU instance already runs one torch thread per core, so more instances only add processes "
              "competing for the same cores (and perf_analyzer, Triton's gRPC front end and other users share "
              "them too); instances whose threads add up to more than the cores oversubscribe them badly. "
              "Raising `count` on CPU therefore needs `num_threads` = cores / count; on GPUs each instance "
              "has its own device."]
    return "\n".join(lines)


def plot_throughput(rows: dict, threads: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for spec in dict.fromkeys(k[0] for k in rows):
        cs = sorted(c for m, c in rows if m == spec)
        label = spec_label(spec, threads)
        a.plot(cs, [rows[(spec, c)]["infer/s"] for c in cs], marker="o", label=label)
        line, = b.plot(cs, [rows[(spec, c)]["p50"] for c in cs], marker="o", label=f"{label}, p50")
        b.plot(cs, [rows[(spec, c)]["p95"] for c in cs], marker="x", linestyle="--", color=line.get_color(),
               label=f"{label}, p95")
    a.set(xlabel="concurrency", ylabel="images / s", title="throughput")
    b.set(xlabel="concurrency", ylabel="ms", title="latency")
    for ax in (a, b):
        ax.set_xticks(sorted({k[1] for k in rows}))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path, "neopp_dense on Triton (perf_analyzer, gRPC)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--small-tokens", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--perf-requests", type=int, default=16, help="requests per perf_analyzer point")
    parser.add_argument("--instances", nargs="+", default=["1", "2", "2:1"],
                        help="instance specs COUNT[:THREADS] (threads 0 or left out: torch's default)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--server-arg", action="append", default=[], help="extra tritonserver argument (repeatable)")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="neopp_serving_bench_") as tmp:
        work = Path(tmp)
        cfg = write_geometry_checkpoint(work / "ckpt")
        kvs = {f"small {args.small_tokens} tokens": random_kv(cfg, args.small_tokens, seed=2),
               f"realistic {args.tokens} tokens": random_kv(cfg, args.tokens, seed=1)}
        kv_mb = {k: v.numel() * v.element_size() / 1e6 for k, v in kvs.items()}
        server = TritonServer(REPO / "model_repository", env=dict(os.environ, NEOPP_CHECKPOINT=str(work / "ckpt")),
                              log_path=work / "tritonserver.log",
                              extra_args=["--model-control-mode=explicit", f"--load-model={MODEL}", *args.server_arg])
        with server:
            threads = server_threads(server)
            torch.set_num_threads(threads)
            pipe = NeoPPPipeline.from_pretrained(work / "ckpt", load_mode(REPO / "configs/neopp/neopp_dense.json"),
                                                 "cpu")
            result, parts = measure_latency(server, pipe, kvs, args.size, args.steps, args.rounds)
            del pipe
            load_mid = os.getloadavg()
            rows = {} if args.skip_throughput else measure_throughput(
                server, work, kvs[list(kvs)[-1]], args.size, args.steps, args.instances, args.concurrency,
                args.perf_requests)
    args.out.mkdir(parents=True, exist_ok=True)
    section_a, ratios = latency_section(result, parts, kv_mb, args.size, args.steps, args.rounds, threads)
    plot_latency(result["times"], args.out / "serving_latency.png")
    body = ["## (a) End-to-end latency: Triton vs in-process", "", section_a, "",
            "![latency](serving_latency.png)"]
    if rows:
        plot_throughput(rows, threads, args.out / "serving_throughput.png")
        body += ["", "## (b) Throughput: 1 and 2 instances of neopp_dense", "",
                 throughput_section(rows, args.perf_requests, threads), "", "![throughput](serving_throughput.png)"]
    load_after = os.getloadavg()
    body += ["", "Load average (1/5/15 min) at the start, after (a), at the end: " + ", ".join(
        f"{a:.1f}/{b:.1f}/{c:.1f}" for a, b, c in (load_before, load_mid, load_after)) +
        ". The machine is shared: compare rows of this run, not runs across machines."]
    for (label, path), r in ratios.items():
        if path != PATHS[0]:
            print(f"ratio {path} / in-process, {label}: {r:.3f}")
    write_report(args.out / "serving.md", "Triton end to end vs in-process; throughput per instance count",
                 "\n".join(body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
