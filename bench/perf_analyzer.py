"""Find and run ``perf_analyzer`` (from tritonclient[all]==2.51.0) with the libraries it needs.

The binary links ``libb64.so.0d`` (Debian package libb64-0d) and ``libcudart.so.12``
(PyPI nvidia-cuda-runtime-cu12, no GPU touched); neither is on a fresh machine's default
search path, so the errors here say exactly what to install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from client_examples.make_perf_data import perf_input_data
from neopp.serving.tritonserver import TritonLaunchError, prepend_path, site_packages_candidates, venv_bin


def cuda_runtime_lib_dir() -> Path | None:
    """``nvidia/cuda_runtime/lib`` of the nvidia-cuda-runtime-cu12 wheel (libcudart.so.12)."""
    for sp in site_packages_candidates():
        lib = sp / "nvidia" / "cuda_runtime" / "lib"
        if (lib / "libcudart.so.12").exists():
            return lib
    return None


def _has_libb64() -> bool:
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib", "/lib"):
        if Path(d, "libb64.so.0d").exists():
            return True
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "libb64.so.0d" in out


def perf_analyzer_command(args: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """argv and env for perf_analyzer from tritonclient[all]; errors say which piece is missing."""
    exe = venv_bin() / "perf_analyzer"
    if not exe.exists():
        found = shutil.which("perf_analyzer")
        if not found:
            raise TritonLaunchError("perf_analyzer not found: pip install 'tritonclient[all]==2.51.0'")
        exe = Path(found)
    if not _has_libb64():
        raise TritonLaunchError(
            "perf_analyzer needs libb64.so.0d: apt-get update && apt-get install -y libb64-0d"
        )
    cudart = cuda_runtime_lib_dir()
    if cudart is None:
        raise TritonLaunchError(
            "perf_analyzer needs libcudart.so.12: pip install nvidia-cuda-runtime-cu12"
        )
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = prepend_path(env.get("LD_LIBRARY_PATH"), str(cudart))
    return [str(exe), *args], env


def run_perf_analyzer(args: Iterable[str], timeout: float | None = None) -> int:
    """Run perf_analyzer in the foreground; returns its exit code."""
    argv, env = perf_analyzer_command(args)
    return subprocess.run(argv, env=env, timeout=timeout).returncode


def bench(model: str, grpc_url: str | None, cond_tokens: int, uncond_tokens: int, size: tuple[int, int],
          steps: int | None, out_dir: Path, extra: list[str], concurrency: str = "1") -> int:
    """perf_analyzer against ``model``: on ``grpc_url``, or on a server started here and stopped after.

    The KV geometry comes from the model's metadata, so the same command benchmarks the tiny
    checkpoint and a real one (env NEOPP_CHECKPOINT).
    """
    import json
    from contextlib import ExitStack

    import tritonclient.grpc as grpcclient

    from bench.common import REPO as REPO_ROOT
    from neopp.serving.tritonserver import TritonServer

    with ExitStack() as stack:
        if grpc_url is None:
            server = TritonServer(REPO_ROOT / "model_repository", log_path=out_dir / "tritonserver.log",
                                  extra_args=["--model-control-mode=explicit", f"--load-model={model}"])
            stack.enter_context(server)
            grpc_url = server.grpc_url
        meta = grpcclient.InferenceServerClient(grpc_url).get_model_metadata(model, as_json=True)
        shape = next(i["shape"] for i in meta["inputs"] if i["name"] == "COND_KV")
        layers, _, _, kv_heads, head_dim = (int(v) for v in shape)
        data_path = out_dir / f"perf_data_{model}.json"
        data = perf_input_data((layers, kv_heads, head_dim), cond_tokens, uncond_tokens or None, size, steps,
                               offsets=(cond_tokens, uncond_tokens))
        data_path.write_text(json.dumps(data))
        # Count windows: one generation can take seconds, so fixed time windows may see none.
        window = [] if any(a.startswith("--measurement") for a in extra) else \
            ["--measurement-mode", "count_windows", "--measurement-request-count", "20"]
        args = ["-m", model, "-i", "grpc", "-u", grpc_url, "--input-data", str(data_path),
                "--concurrency-range", concurrency, *window, *extra]
        print("perf_analyzer", " ".join(args), flush=True)
        return run_perf_analyzer(args)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=bench.__doc__)
    p.add_argument("--model", default="neopp_dense")
    p.add_argument("--grpc-url", default=None, help="a running server (default: start one on free ports)")
    p.add_argument("--cond-tokens", type=int, default=256)
    p.add_argument("--uncond-tokens", type=int, default=16)
    p.add_argument("--size", type=int, nargs=2, default=(256, 256), metavar=("H", "W"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--concurrency", default="1", help="perf_analyzer --concurrency-range, e.g. 1:4")
    p.add_argument("--out-dir", type=Path, default=Path("build/bench_serve"))
    p.add_argument("extra", nargs="*", help="after --: more perf_analyzer arguments")
    ns = p.parse_args(argv)
    ns.out_dir.mkdir(parents=True, exist_ok=True)
    try:
        return bench(ns.model, ns.grpc_url, ns.cond_tokens, ns.uncond_tokens, tuple(ns.size), ns.steps,
                     ns.out_dir, ns.extra, ns.concurrency)
    except TritonLaunchError as exc:
        print(f"error: {exc}")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
