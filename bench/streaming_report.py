"""The continuous-batching serving report: perf_analyzer CSV parsing, tables, goals, GPU estimate, plot.

Pure functions over the figures ``bench.streaming_serving`` measures, kept apart so their format
is unit-tested (tests/test_streaming_report.py) without starting a server.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from bench.common import save_figure
from bench.geometry import EIGHT_B, tower_shapes
from bench.step_efficiency import flops, gemm_shapes
from neopp.model.checkpoint_config import CheckpointConfig

STREAM, PLAIN, PLAIN_X2 = "neopp_dense_stream", "neopp_dense", "neopp_dense_x2"
CONFIGS = (("batching", STREAM), ("one plain", PLAIN), ("two plain", PLAIN_X2))
MIB = 2**20
# H200 (SXM): dense bf16 tensor-core rate and HBM3e bandwidth from the data sheet.
H200_FLOPS, H200_BYTES_S = 990e12, 4.8e12


# perf_analyzer's CSV splits the mean latency into these parts (microseconds); they add up to it.
LATENCY_PARTS = ("Client Send", "Network+Server Send/Recv", "Server Queue", "Server Compute Input",
                 "Server Compute Infer", "Server Compute Output", "Client Recv")


@dataclass(frozen=True)
class PerfPoint:
    """One perf_analyzer point: requests completed per second and client latency percentiles (ms).

    ``infer_s`` is concurrency / mean latency (Little's law: every slot of a closed loop always
    has one request out). perf_analyzer's own figure (``pa_infer_s``) divides by its windows'
    length in whole seconds, too coarse for runs of a few seconds (it read 3.996 and 7.996 where
    the requests' own timestamps gave 5.8 and 8.2 per second).
    """

    infer_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    pa_infer_s: float
    responses_s: float | None = None  # decoupled models: responses per second (one per step)


def parse_perf_csv(text: str) -> PerfPoint:
    """The first row of perf_analyzer's ``-f`` CSV (latencies there are in microseconds).

    A streaming (decoupled) run adds "Response Throughput"; its latency is send to final response.
    """
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise ValueError("perf_analyzer CSV has no data row")
    row = rows[0]
    missing = [k for k in ("Concurrency", "Inferences/Second", "p50 latency", "p99 latency", *LATENCY_PARTS)
               if k not in row]
    if missing:
        raise ValueError(f"perf_analyzer CSV lacks the columns {missing}")
    mean_ms = sum(float(row[k]) for k in LATENCY_PARTS) / 1e3
    responses = row.get("Response Throughput")
    return PerfPoint(int(row["Concurrency"]) / (mean_ms / 1e3), float(row["p50 latency"]) / 1e3,
                     float(row["p99 latency"]) / 1e3, mean_ms, float(row["Inferences/Second"]),
                     float(responses) if responses else None)


def ratio(rows: dict, size: int, c: int, other: str, key: str = "infer_s") -> float:
    """batching / ``other`` for one figure of one point."""
    return getattr(rows[("batching", size, c)], key) / getattr(rows[(other, size, c)], key)


def points(rows: dict) -> list[tuple[int, int]]:
    """(size, concurrency) in the order measured."""
    return list(dict.fromkeys((size, c) for _label, size, c in rows))


def throughput_table(rows: dict) -> list[str]:
    lines = ["| size | concurrency | images/s batching | one plain | two plain | batching / one plain | "
             "batching / two plain | p50 ms batching / one / two | p99 ms batching / one / two |",
             "|---|---|---|---|---|---|---|---|---|"]
    for size, c in points(rows):
        got = [rows[(label, size, c)] for label, _m in CONFIGS]
        lines.append(f"| {size}x{size} | {c} | {got[0].infer_s:.2f} | {got[1].infer_s:.2f} | {got[2].infer_s:.2f} | "
                     f"{ratio(rows, size, c, 'one plain'):.2f} | **{ratio(rows, size, c, 'two plain'):.2f}** | "
                     + " / ".join(f"{p.p50_ms:.0f}" for p in got) + " | "
                     + " / ".join(f"{p.p99_ms:.0f}" for p in got) + " |")
    return lines


def goal_lines(rows: dict, memory: dict[str, dict[str, int]]) -> list[str]:
    """The two goals, judged per size: throughput >= two plain instances at concurrency >= 2, and
    p99 at concurrency 4 <= two plain instances'; plus the memory half of the first goal."""
    out = []
    for size in dict.fromkeys(s for s, _c in points(rows)):
        busy = [c for s, c in points(rows) if s == size and c >= 2]
        met = [c for c in busy if ratio(rows, size, c, "two plain") >= 1.0]
        out.append(f"* {size}x{size}, throughput >= two plain instances: {'met' if len(met) == len(busy) else 'missed'}"
                   f" at {len(met)} of {len(busy)} concurrencies >= 2 ({', '.join(map(str, met)) or 'none'}).")
        if ("batching", size, 4) in rows:
            b, two = rows[("batching", size, 4)].p99_ms, rows[("two plain", size, 4)].p99_ms
            out.append(f"* {size}x{size}, p99 at concurrency 4: batching {b:.0f} ms vs two plain {two:.0f} ms: "
                       f"**{'met' if b <= two else 'missed'}**.")
    one, two = memory[STREAM]["total"], memory[PLAIN_X2]["total"]
    out.append(f"* Memory: the batching instance's stub holds {one / MIB:.0f} MiB resident, the two plain "
               f"instances' stubs {two / MIB:.0f} MiB ({one / two:.2f} of it).")
    return out


def preview_table(previews: dict, rows: dict) -> list[str]:
    """Time to the first preview and to the image (medians, max) next to the plain model's p50."""
    lines = ["| size | concurrency | first preview ms median (max) | image ms median (max) | "
             "one plain p50 ms (perf_analyzer) |", "|---|---|---|---|---|"]
    for (size, c), samples in previews.items():
        first, image = [s[0] * 1e3 for s in samples], [s[1] * 1e3 for s in samples]
        plain = rows.get(("one plain", size, c))
        lines.append(f"| {size}x{size} | {c} | {statistics.median(first):.0f} ({max(first):.0f}) | "
                     f"{statistics.median(image):.0f} ({max(image):.0f}) | "
                     f"{f'{plain.p50_ms:.0f}' if plain else '-'} |")
    return lines


def memory_table(loaded: dict, after: dict) -> list[str]:
    lines = ["| model | stubs | RSS after load MiB | RSS after the run MiB | anon | file | shmem |",
             "|---|---|---|---|---|---|---|"]
    for _label, model in CONFIGS:
        a = after[model]
        lines.append(f"| {model} | {a['stubs']} | {loaded[model]['total'] / MIB:.0f} | {a['total'] / MIB:.0f} | "
                     f"{a['anon'] / MIB:.0f} | {a['file'] / MIB:.0f} | {a['shmem'] / MIB:.0f} |")
    return lines


# ---------------------------------------------------------------- GPU estimate (roofline)


def weight_bytes(itemsize: int = 2) -> int:
    """Bytes of the 8B tower's weights (every key the loader checks: bench/geometry), all read once per step."""
    cfg = CheckpointConfig.from_dict(EIGHT_B.config())
    return sum(math.prod(shape) for shape in tower_shapes(cfg).values()) * itemsize


def step_estimate(size: int, requests: int, prefixes: tuple[int, ...] = (256, 16), peak: float = H200_FLOPS,
                  bandwidth: float = H200_BYTES_S) -> tuple[float, str]:
    """(seconds, bound) of one step batching ``requests`` requests of ``size``x``size``, one branch per prefix.

    Roofline for the 8B tower: the weights are read once per step whatever the batch; each branch
    adds its FLOPs (GEMMs and attention) and reads its own prefix KV (bf16). Activations are left out.
    """
    geo = EIGHT_B
    tokens = (size // 32) ** 2
    work = requests * sum(flops(gemm_shapes(geo, tokens, p)) for p in prefixes)
    kv = requests * sum(geo.layers * 2 * p * geo.kv_heads * geo.head_dim * 2 for p in prefixes)
    compute, memory = work / peak, (weight_bytes() + kv) / bandwidth
    return max(compute, memory), "compute" if compute >= memory else "memory"


def crossover_tokens(peak: float = H200_FLOPS, bandwidth: float = H200_BYTES_S, itemsize: int = 2) -> float:
    """Token rows per step at which a bf16 GEMM turns compute-bound: 2 T K N FLOP over K N x itemsize bytes."""
    return peak / bandwidth * itemsize / 2


def gpu_section(sizes: tuple[int, ...] = (256, 512), counts: tuple[int, ...] = (1, 2, 4, 8)) -> list[str]:
    cross = crossover_tokens()
    lines = ["Roofline estimate, not a measurement: on an H200 `make gpu-check` measured these sizes bound by "
             "kernel launches instead, where batching gained more (bench/continuous_batching_gpu.md). The 8B "
             f"tower reads {weight_bytes() / 1e9:.1f} GB of bf16 weights per step whatever the batch, "
             f"and does about 2 FLOP per weight per image token. A bf16 GEMM over T token rows does 2TKN FLOP on "
             f"2KN weight bytes, T FLOP per byte; an H200 (about {H200_FLOPS / 1e12:.0f} dense bf16 TFLOP/s, "
             f"{H200_BYTES_S / 1e12:.1f} TB/s) becomes compute-bound at T = {cross:.0f} token rows per step "
             "(all requests and branches of the step together). A guided request (cond 256 + uncond 16 prefix "
             "tokens) has 2 x (size/32)^2 rows: "
             + ", ".join(f"{s}x{s}: {2 * (s // 32) ** 2}" for s in sizes)
             + ". Below the crossover a step costs the weight read, so batching N requests multiplies "
             "throughput by up to N; above it the GEMMs dominate and batching gains little beyond filling "
             "the GPU. Roofline time of one step (max of FLOP / peak and bytes / bandwidth):", "",
             "| size | requests per step | rows | step ms | bound | images/s vs one request per step |",
             "|---|---|---|---|---|---|"]
    for size in sizes:
        solo, _ = step_estimate(size, 1)
        for n in counts:
            t, bound = step_estimate(size, n)
            lines.append(f"| {size}x{size} | {n} | {2 * n * (size // 32) ** 2} | {t * 1e3:.2f} | {bound} | "
                         f"{n * solo / t:.2f}x |")
    return lines


# ---------------------------------------------------------------- assembled report and plot


def report_body(rows: dict, previews: dict, loaded: dict, after: dict, settings: dict, plot: str | None) -> str:
    s = settings
    cores = s["cores"]
    lines = [f"Tritonserver on free loopback ports, models from a temporary copy of `model_repository/`, checkpoint "
             f"`{s['checkpoint']}` ({s['weights'] / MIB:.1f} MiB of weights): `{STREAM}` (1 instance, the "
             f"step-batching engine, torch's default threads), `{PLAIN}` (1 instance, default threads), "
             f"`{PLAIN_X2}` (the same plain model with `instance_group count: 2`, {s['x2_threads']} torch "
             f"thread(s) each so the two together use the {cores} cores). Guided requests (cond {s['cond']} + "
             f"uncond {s['uncond']} prefix tokens), {s['steps']} steps, PNG. perf_analyzer (gRPC; `--streaming` "
             f"for the streaming model, whose latency is send to final response) with exactly "
             f"{s['per_slot']} requests per concurrent slot and at least 8 (`--request-count`; with so few, p99 is "
             "about the maximum); images/s = concurrency / mean latency (Little's law; perf_analyzer's own figure "
             "divides by whole-second windows, too coarse for runs this short), after 2 warm-up requests per "
             "model and size; the three configurations "
             "measured one after the other at every point, their order rotating. Windows are kept short so the "
             f"whole run stays within about a quarter of an hour on this {cores}-core machine (this one: "
             f"{s['minutes']:.1f} min{', `--quick` matrix' if s['quick'] else ''}).", "",
             *throughput_table(rows), ""]
    if plot:
        lines += [f"![throughput vs concurrency]({plot})", ""]
    else:
        lines += ["(No plot: matplotlib is not installed in this environment.)", ""]
    lines += ["Goals (one batching instance: at least two plain instances' throughput with half their weight "
              "memory; p99 at concurrency 4 no worse than theirs):", "", *goal_lines(rows, after), "",
              f"### Time to the first preview ({STREAM}, `PREVIEW_EVERY` 1)", "",
              f"tritonclient gRPC, one stream per concurrent client, all started together, {s['preview_rounds']} "
              "round(s) per point after the perf_analyzer runs. The plain model sends nothing until its image.", "",
              *preview_table(previews, rows), "",
              "### Resident memory of the model stubs", "",
              "Stub processes found as children of the server started here (`neopp.procs.model_stubs`), "
              "summed per model; shmem is the Python backend's shared regions as each stub mapped them.", "",
              *memory_table(loaded, after), "",
              "### What the same design gives on a GPU (estimate)", "", *gpu_section(), "",
              "### Reading", "",
              f"On this machine every configuration competes for the same {cores} shared cores: one plain "
              "instance already runs one torch thread per core, two plain instances split them, and the batching "
              "engine's gain is fewer passes over the weights per image plus per-step overheads shared by the "
              "batch. The tiny checkpoint's weights are a few MiB, so on a CPU a step is bound by per-request "
              "work (attention over each prefix, embedding, head, PNG encoding, gRPC) rather than by reading "
              "weights, and the RSS is mostly the runtime each stub loads (torch, Python), which a second "
              "instance duplicates just the same. The GPU estimate above is where reading the weights once per "
              "step pays. Load average (1/5/15 min) at the start and at the end: "
              + ", ".join(f"{a:.1f}/{b:.1f}/{c:.1f}" for a, b, c in s["load"]) + "."]
    return "\n".join(lines)


def plot_throughput(rows: dict, path: Path) -> bool:
    """Throughput vs concurrency of the three configurations, one panel per size; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(s for s, _c in points(rows)))
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        for label, _model in CONFIGS:
            cs = [c for s, c in points(rows) if s == size]
            ax.plot(cs, [rows[(label, size, c)].infer_s for c in cs], marker="o", label=label)
        ax.set(xlabel="concurrency", ylabel="images / s", title=f"{size}x{size}")
        ax.set_xticks(cs)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path, "Continuous batching on Triton (perf_analyzer, gRPC)")
    return True
