"""The continuous-batching serving report's pure parts: perf_analyzer CSV, tables, goals, GPU estimate.

The benchmark itself needs a server and a quarter of an hour; these catch a format change in
perf_analyzer's CSV, in the committed config the two-instance variant is derived from, or in
the report's arithmetic.
"""

from __future__ import annotations

import pytest

from bench.streaming_report import (
    CONFIGS,
    MIB,
    PLAIN,
    PLAIN_X2,
    STREAM,
    PerfPoint,
    crossover_tokens,
    goal_lines,
    parse_perf_csv,
    step_estimate,
    throughput_table,
    weight_bytes,
)
from bench.streaming_serving import build_repository
from testing import REPO

# perf_analyzer 2.51 CSVs as written by `-f` in this benchmark (streaming to a decoupled model, then plain).
STREAM_CSV = ("Concurrency,Inferences/Second,Response Throughput,Client Send,Network+Server Send/Recv,Server Queue,"
              "Server Compute Input,Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,"
              "p95 latency,p99 latency\n2,2.66456,21.3165,0,552643,721,81,6289,23,0,559970,630909,674107,674107\n")
PLAIN_CSV = ("Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,"
             "Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,"
             "p99 latency\n2,1.99869,45,2801,432457,85,462760,1617,197,725569,1919067,1950612,1950612\n")


def test_perf_csv_streaming_and_plain():
    s = parse_perf_csv(STREAM_CSV)
    # mean = 0 + 552643 + 721 + 81 + 6289 + 23 + 0 us; 2 requests always out -> 2 / 0.559757 s per second
    expected = (2 / 0.559757, 559.970, 674.107, 559.757, 2.66456, 21.3165)  # us in the CSV, ms out
    assert list(s.__dict__.values()) == pytest.approx(expected)
    p = parse_perf_csv(PLAIN_CSV)
    # 45 + 2801 + 432457 + 85 + 462760 + 1617 + 197 us (perf_analyzer printed a mean of 899966: parts rounded)
    assert p.mean_ms == pytest.approx(899.962)
    assert (p.infer_s, p.p50_ms, p.p99_ms) == pytest.approx((2 / 0.899962, 725.569, 1950.612))
    assert p.responses_s is None


def test_perf_csv_errors_name_what_is_missing():
    with pytest.raises(ValueError, match="no data row"):
        parse_perf_csv(PLAIN_CSV.splitlines()[0] + "\n")
    with pytest.raises(ValueError, match="p99 latency"):
        parse_perf_csv("Concurrency,Inferences/Second,p50 latency\n1,2,3\n")
    with pytest.raises(ValueError, match="Server Queue"):  # the mean latency cannot be summed
        parse_perf_csv(PLAIN_CSV.replace("Server Queue", "Queue"))


def _rows(batching: float, two: float, p99_b: float, p99_two: float) -> dict:
    out = {}
    for c in (1, 2, 4):
        out[("batching", 256, c)] = PerfPoint(batching * c, 100.0, p99_b, 100.0, 0.0)
        out[("one plain", 256, c)] = PerfPoint(1.0, 100.0, 500.0, 100.0, 0.0)
        out[("two plain", 256, c)] = PerfPoint(two * c, 100.0, p99_two, 100.0, 0.0)
    return out


MEMORY = {STREAM: {"total": 300 * MIB}, PLAIN: {"total": 300 * MIB}, PLAIN_X2: {"total": 600 * MIB}}


def test_table_ratios_and_goals_met():
    rows = _rows(batching=3.0, two=2.0, p99_b=400.0, p99_two=450.0)
    table = throughput_table(rows)
    assert len(table) == 2 + 3
    # concurrency 4: batching 12, one plain 1, two plain 8 -> 12.00 and 1.50
    assert table[-1].startswith("| 256x256 | 4 | 12.00 | 1.00 | 8.00 | 12.00 | **1.50** |")
    goals = "\n".join(goal_lines(rows, MEMORY))
    assert "met at 2 of 2 concurrencies >= 2 (2, 4)" in goals
    assert "batching 400 ms vs two plain 450 ms: **met**" in goals
    assert "0.50 of it" in goals


def test_goals_missed():
    goals = "\n".join(goal_lines(_rows(batching=1.5, two=2.0, p99_b=500.0, p99_two=450.0), MEMORY))
    assert "missed at 0 of 2 concurrencies >= 2 (none)" in goals
    assert "**missed**" in goals


def test_gpu_estimate_against_a_hand_count():
    # 8B tower by hand: per layer q, k, v, o (4096 wide, 8 x 128 KV) and a 12288-wide gated MLP; then the
    # patch and 2x2 dense embeddings, timestep and noise-scale embedders and the pixel head. Norms and
    # biases are left out here: 0.1% covers them.
    per_layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 12288
    rest = 1024 * 3 * 16 * 16 + 4096 * 1024 * 4 + 2 * (4096 * 256 + 4096 * 4096) + 4096 * 4096 + 3072 * 4096
    assert weight_bytes() == pytest.approx((36 * per_layer + rest) * 2, rel=0.001)
    assert crossover_tokens() == pytest.approx(990 / 4.8)  # bf16: T FLOP per weight byte
    # 256x256 guided: 2 x 64 rows, under the crossover -> memory-bound alone, compute-bound at 4 requests
    assert step_estimate(256, 1)[1] == "memory"
    assert step_estimate(256, 4)[1] == "compute"
    assert step_estimate(512, 1)[1] == "compute"  # 512 rows
    # a memory-bound step costs the weight read: about 14 GB / 4.8 TB/s
    assert step_estimate(256, 1)[0] == pytest.approx(weight_bytes() / 4.8e12, rel=0.01)
    for n in (2, 4, 8):  # batching never costs more than running the requests one per step
        assert step_estimate(256, n)[0] <= n * step_estimate(256, 1)[0]


def test_two_instance_variant_derives_from_the_committed_config(tmp_path):
    repo = build_repository(tmp_path, x2_threads=1)
    assert sorted(p.name for p in repo.iterdir()) == sorted(m for _label, m in CONFIGS)
    text = (repo / PLAIN_X2 / "config.pbtxt").read_text()
    assert f'name: "{PLAIN_X2}"' in text and "count: 2 }" in text
    assert 'key: "num_threads" value: { string_value: "1" }' in text
    committed = REPO / "model_repository" / PLAIN / "config.pbtxt"
    assert (repo / PLAIN / "config.pbtxt").read_text() == committed.read_text()  # copied, never edited
