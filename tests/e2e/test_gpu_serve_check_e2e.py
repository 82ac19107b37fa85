"""`make gpu-serve-check`'s code on the CPU: the tiny checkpoint, one small size, the real
tritonserver twice (latency, then throughput) and perf_analyzer; every figure of the report."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from testing import REPO


def test_the_serving_check_reports_every_figure(tiny_dense: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench.gpu_serve_check", "--device", "cpu", "--config", "", "--checkpoint",
           str(tiny_dense), "--quick", "--sizes", "64", "--batching-sizes", "64", "--steps", "2",
           "--batching-steps", "2", "--per-slot", "1", "--out", str(tmp_path), "--work", str(tmp_path / "work")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (tmp_path / "gpu_serving.md").read_text()
    assert "libpython3" in report and "found" in report and "numpy 1." in report
    assert (tmp_path / "work" / "tritonserver_latency.log").is_file()  # kept for a run cut short
    assert "same picture on every path: yes" in report
    for path in ("in-process", "Triton gRPC", "Triton shared memory"):
        assert re.search(rf"^  {path} +[\d.]+ ms  x[\d.]+", report, re.MULTILINE), path
    # the second figure is the total less what the server timed: noise can make it a little negative
    assert re.search(r"^  \| Triton shared memory \| [\d.]+ \| -?[\d.]+ \|", report, re.MULTILINE)
    assert re.search(r"streamed 64x64 with a preview every step: first preview \d+ ms, image \d+ ms", report)
    for c in (1, 2):
        line = next(x for x in report.splitlines() if x.startswith(f"  64x64 concurrency {c}:"))
        assert all(label in line for label in ("batching", "one plain", "two plain")), line
