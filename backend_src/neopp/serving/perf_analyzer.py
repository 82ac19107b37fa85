"""Find and run ``perf_analyzer`` (from tritonclient[all]==2.51.0) with the libraries it needs.

The binary links ``libb64.so.0d`` (Debian package libb64-0d) and ``libcudart.so.12``
(PyPI nvidia-cuda-runtime-cu12, no GPU touched); neither is on a fresh machine's default
search path, so the errors here say exactly what to install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterable

from .tritonserver import TritonLaunchError, _prepend, _site_packages_candidates, _venv_bin



def cuda_runtime_lib_dir() -> Path | None:
    """``nvidia/cuda_runtime/lib`` of the nvidia-cuda-runtime-cu12 wheel (libcudart.so.12)."""
    for sp in _site_packages_candidates():
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
    exe = _venv_bin() / "perf_analyzer"
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
    env["LD_LIBRARY_PATH"] = _prepend(env.get("LD_LIBRARY_PATH"), str(cudart))
    return [str(exe), *args], env


def run_perf_analyzer(args: Iterable[str], timeout: float | None = None) -> int:
    """Run perf_analyzer in the foreground; returns its exit code."""
    argv, env = perf_analyzer_command(args)
    return subprocess.run(argv, env=env, timeout=timeout).returncode
