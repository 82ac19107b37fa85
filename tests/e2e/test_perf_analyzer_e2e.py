"""perf_analyzer, as `make bench-serve` runs it, against a server that is already running."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import perf_analyzer
from neopp.launcher.tritonserver import TritonLaunchError
from neopp.ports import free_ports


def test_settings_yield_to_the_callers_own_flags() -> None:
    assert perf_analyzer.measurement_args([]) == ["--request-count", "30", "--stability-percentage", "50",
                                                  "--max-trials", "10"]
    mine = perf_analyzer.measurement_args(["--measurement-interval=5000", "--stability-percentage", "10"])
    assert mine == ["--max-trials", "10"]
    assert perf_analyzer.measurement_args(["--request-count", "8"]) == ["--stability-percentage", "50",
                                                                        "--max-trials", "10"]


def test_no_server_says_what_to_start() -> None:
    (port,) = free_ports(1)
    with pytest.raises(TritonLaunchError, match="make serve.*--own-server"):
        perf_analyzer.model_kv_shape(f"127.0.0.1:{port}", "neopp_dense")


@pytest.mark.skipif(not perf_analyzer._has_libb64(), reason="perf_analyzer needs libb64.so.0d: run `make deps`")
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_measures_the_running_server(triton, protocol: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Over gRPC straight to Triton, over HTTP through the door (binary tensors, the model config read there)."""
    over = ["--http-url", triton.door_url] if protocol == "http" else []
    code = perf_analyzer.main(["--grpc-url", triton.server.grpc_url, *over, "--size", "64", "64", "--steps", "1",
                               "--cond-tokens", "24", "--uncond-tokens", "7", "--out-dir", str(tmp_path),
                               "--", "--request-count", "8"])  # a fixed count: no stability to wait for
    out = capfd.readouterr().out
    assert code == 0, out[-3000:]
    assert "settings --stability-percentage 50 --max-trials 10" in out and "--request-count 8" in out
    assert "Concurrency: 1, throughput:" in out
