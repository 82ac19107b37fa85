"""Run ``perf_analyzer`` (from tritonclient[all]==2.51.0) against a NeoPP model.

By default it measures the server ``make serve`` runs (``--grpc-url``, default
localhost:8001); ``--own-server`` starts one on free ports instead and stops it after. The
KV geometry comes from the model's metadata, so the same command measures the tiny
checkpoint and a real one.

Measurement settings fit a small shared machine: one generation takes far longer than a
usual inference, so windows count requests (``count_windows``) instead of timing a few
seconds, and a window is stable within 50% of the last ones (perf_analyzer's 10% fails on a
busy 2-core machine). They are printed before the run; flags after ``--`` override them.

The binary links ``libb64.so.0d`` (Debian package libb64-0d: ``make deps``) and
``libcudart.so.12`` (PyPI nvidia-cuda-runtime-cu12, no GPU touched); neither is on a fresh
machine's default search path, so the errors here say exactly what to install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from client_examples.make_perf_data import perf_input_data
from neopp.cli.client import CliError, server_addresses
from neopp.launcher.admin import GRPC_HEADER, KEY_ENV, KEY_HEADER
from neopp.launcher.triton_install import (
    SYSTEM_LIB_DIRS,
    SYSTEM_ROOT_ENV,
    TritonLaunchError,
    prepend_path,
    site_packages_candidates,
    venv_bin,
)


def cuda_runtime_lib_dir() -> Path | None:
    """``nvidia/cuda_runtime/lib`` of the nvidia-cuda-runtime-cu12 wheel (libcudart.so.12)."""
    for sp in site_packages_candidates():
        lib = sp / "nvidia" / "cuda_runtime" / "lib"
        if (lib / "libcudart.so.12").exists():
            return lib
    return None


def _has_libb64() -> bool:
    for d in SYSTEM_LIB_DIRS:
        if Path(d, "libb64.so.0d").exists():
            return True
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "libb64.so.0d" in out


def perf_analyzer_command(args: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """argv and env for perf_analyzer: the GPU bundle's (with its own libraries) where
    $NEOPP_TRITONSERVER_ROOT holds one, else tritonclient[all]'s; errors say which piece is missing."""
    bundled = Path(os.environ.get(SYSTEM_ROOT_ENV) or "/nonexistent") / "bin" / "perf_analyzer"
    if bundled.is_file():
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = prepend_path(env.get("LD_LIBRARY_PATH"), str(bundled.parent.parent / "lib"))
        return [str(bundled), *args], env
    exe = venv_bin() / "perf_analyzer"
    if not exe.exists():
        found = shutil.which("perf_analyzer")
        if not found:
            raise TritonLaunchError("perf_analyzer not found: pip install 'tritonclient[all]==2.51.0'")
        exe = Path(found)
    if not _has_libb64():
        raise TritonLaunchError(
            "perf_analyzer needs libb64.so.0d: run `make deps` as root "
            "(apt-get update && apt-get install -y libb64-0d)"
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


# A fixed count of requests, measured once: on a busy machine the windows perf_analyzer compares
# for stability never agree (one generation takes far longer than a usual inference, and the
# neighbours' load comes and goes), so a stability wait may never end. Stable within this % and at
# most this many windows hold only when the caller asks for windows instead.
MEASUREMENT = {"--request-count": "30", "--stability-percentage": "50", "--max-trials": "10"}
WINDOW_FLAGS = ("--measurement-interval", "--measurement-mode", "--measurement-request-count")


def measurement_args(extra: list[str]) -> list[str]:
    """MEASUREMENT, less what the caller's own perf_analyzer flags set (windows of their own
    replace the fixed count)."""
    given = {a.split("=", 1)[0] for a in extra if a.startswith("--")}
    if given & set(WINDOW_FLAGS):
        given.add("--request-count")
    return [part for flag, value in MEASUREMENT.items() if flag not in given for part in (flag, value)]


def model_kv_shape(grpc_url: str, model: str) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) from the model's metadata; the error says what to start."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    try:
        client = grpcclient.InferenceServerClient(grpc_url)
        if not client.is_model_ready(model):
            raise TritonLaunchError(f"model {model} is not ready on {grpc_url} (make serve SERVE_MODELS=... "
                                    "loads it)")
        meta = client.get_model_metadata(model, as_json=True)
    except InferenceServerException as exc:
        raise TritonLaunchError(f"no server answers at {grpc_url} ({exc.message()}): start one with "
                                "`make serve`, or pass --own-server") from None
    shape = next(i["shape"] for i in meta["inputs"] if i["name"] == "COND_KV")
    layers, _, _, kv_heads, head_dim = (int(v) for v in shape)
    return layers, kv_heads, head_dim


def operator_key(key_file: Path) -> str | None:
    """The operator key perf_analyzer needs to read the model config: $NEOPP_ADMIN_KEY, else the file."""
    if os.environ.get(KEY_ENV):
        return os.environ[KEY_ENV].strip()
    return key_file.read_text().strip() if key_file.is_file() else None


def bench(model: str, grpc_url: str | None, cond_tokens: int, uncond_tokens: int, size: tuple[int, int],
          steps: int | None, out_dir: Path, extra: list[str], concurrency: str = "1",
          key_file: Path = Path("build/admin.key"), http_url: str | None = None) -> int:
    """perf_analyzer against ``model`` on ``grpc_url``; None: on a server started here, stopped after.
    With ``http_url`` it measures over HTTP there (the launcher's door); the KV geometry is still
    read over gRPC.

    perf_analyzer reads the model config, which a restricted server (``make serve``) answers
    only with the operator key: it goes along as a gRPC header and is never printed.
    """
    import json
    from contextlib import ExitStack

    from bench.common import REPO as REPO_ROOT
    from neopp.launcher.tritonserver import TritonServer

    with ExitStack() as stack:
        if grpc_url is None:
            server = TritonServer(REPO_ROOT / "model_repository", log_path=out_dir / "tritonserver.log",
                                  extra_args=["--model-control-mode=explicit", f"--load-model={model}"])
            print(f"starting a server of its own for {model} (log {out_dir / 'tritonserver.log'})", flush=True)
            stack.enter_context(server)
            grpc_url = server.grpc_url
        layers, kv_heads, head_dim = model_kv_shape(grpc_url, model)
        data_path = out_dir / f"perf_data_{model}.json"
        data = perf_input_data((layers, kv_heads, head_dim), cond_tokens, uncond_tokens or None, size, steps,
                               offsets=(cond_tokens, uncond_tokens))
        data_path.write_text(json.dumps(data))
        window = measurement_args(extra)
        protocol, url, header = ("http", http_url, KEY_HEADER) if http_url else ("grpc", grpc_url, GRPC_HEADER)
        args = ["-m", model, "-i", protocol, "-u", url, "--input-data", str(data_path),
                "--concurrency-range", concurrency, *window, *extra]
        print(f"measuring {model} on {url} ({protocol}): KV {layers} layers x {kv_heads} heads x {head_dim}, "
              f"{cond_tokens}+{uncond_tokens} prefix tokens, {size[0]}x{size[1]}, {steps} steps; "
              f"settings {' '.join(window) or '(yours)'}", flush=True)
        print("perf_analyzer", " ".join(args), flush=True)
        key = operator_key(key_file)
        return run_perf_analyzer([*args, "-H", f"{header}:{key}"] if key else args)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=bench.__doc__)
    p.add_argument("--model", default="neopp_dense")
    p.add_argument("--grpc-url", default=None,
                   help="the server to measure (default: the one NEOPP_URL names, else make serve's localhost:8001)")
    p.add_argument("--http-url", default=None,
                   help="measure over HTTP at this address (make serve's: localhost:8000) instead of gRPC")
    p.add_argument("--own-server", action="store_true", help="start a server on free ports instead, stop it after")
    p.add_argument("--admin-key-file", type=Path, default=Path("build/admin.key"),
                   help=f"operator key of the server (default build/admin.key; ${KEY_ENV} wins)")
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
        if ns.grpc_url is None and not ns.own_server:
            ns.grpc_url = server_addresses(os.environ["NEOPP_URL"])[1] if os.environ.get("NEOPP_URL") else \
                "localhost:8001"
        return bench(ns.model, None if ns.own_server else ns.grpc_url, ns.cond_tokens, ns.uncond_tokens,
                     tuple(ns.size), ns.steps, ns.out_dir, ns.extra, ns.concurrency, ns.admin_key_file, ns.http_url)
    except (TritonLaunchError, CliError) as exc:
        print(f"error: {exc}")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
