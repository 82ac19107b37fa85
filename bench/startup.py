"""Start time and first-request latency of the served models, warm-up at load off vs on.

    python -m bench.startup [--out bench] [--rounds 2] [--steps 4]
    python -m bench.startup --baseline OTHER_CHECKOUT [--rounds 3]   (bench/startup_baseline.md)

Each round starts the server twice, alternately without and with the warm-up (the ``warmup``
parameter, set in a copy of the model repository), on the models and tiny checkpoints of
``make serve``. It records the time to ready, each model's load time (Triton's ``loading`` to
``successfully loaded`` log lines), then times four requests at each model's default size
(no SIZE input) on ``neopp_dense`` and ``neopp_dense_cfg``: the first against the median of
the next three. The import time of the session model's code (it no longer needs torch) is
measured beside a plain ``import torch``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from bench.common import REPO, section_main
from neopp.launcher.model_states import KEEP_GOING_ARGS
from neopp.launcher.tritonserver import TritonLaunchError, TritonServer
from neopp.model.kv_cache import load_kv_file
from testing.loadgen import grpc_inputs

MODELS = ("neopp_dense", "neopp_dense_fp8", "neopp_dense_cfg", "neopp_dense_cfg_seq", "neopp_dense_8steps",
          "neopp_moe", "neopp_moe_cfg", "neopp_session")
TIMED = ("neopp_dense", "neopp_dense_cfg")
TINY = REPO / "build" / "tiny"
_STAMP = r"^[IWE](\d{4} [\d:.]+)\s+\d+ [\w.]+:\d+\] "


def repository_copy(root: Path, warmup: bool) -> Path:
    """The model repository with every generation model's ``warmup`` parameter set."""
    repo = root / f"repo_{'on' if warmup else 'off'}"
    shutil.copytree(REPO / "model_repository", repo)
    for config in repo.glob("*/config.pbtxt"):
        if config.parent.name in ("neopp_session", "neopp_t2i", "neopp_prompt_encoder"):  # nothing to warm up
            continue
        text, count = re.subn(r'(key: "warmup" value: \{ string_value: )"\w+"', rf'\1"{str(warmup).lower()}"',
                              config.read_text())
        assert count == 1, config
        config.write_text(text)
    return repo


def load_seconds(log: str) -> dict[str, float]:
    """Per model: Triton's ``loading: M:1`` to ``successfully loaded 'M'``."""
    def when(pattern: str) -> dict[str, datetime]:
        return {m.group(2): datetime.strptime(m.group(1), "%m%d %H:%M:%S.%f")
                for m in re.finditer(_STAMP + pattern, log, re.MULTILINE)}
    begun, done = when(r'"loading: (\w+):\d+"'), when(r"\"successfully loaded '(\w+)'\"")
    return {m: (done[m] - begun[m]).total_seconds() for m in begun if m in done}


def request_inputs(steps: int) -> list[grpcclient.InferInput]:
    kv = TINY / "dense" / "sample_kv"
    values = {"COND_KV": (load_kv_file(kv / "cond_kv.pt").float().numpy(), "BF16"),
              "UNCOND_KV": (load_kv_file(kv / "uncond_kv.pt").float().numpy(), "BF16"),
              "INDEX_OFFSET_COND": (np.array([24], np.int64), "INT64"),
              "INDEX_OFFSET_UNCOND": (np.array([7], np.int64), "INT64"),
              "STEPS": (np.array([steps], np.int64), "INT64"), "SEED": (np.array([1], np.int64), "INT64")}
    return grpc_inputs(values)


def serve_env(checkout: Path) -> dict[str, str]:
    """Our environment plus what ``make serve`` sets: the checkout's tiny checkpoints and LoRA."""
    tiny = checkout / "build" / "tiny"
    return {**os.environ, "NEOPP_CHECKPOINT": str(tiny / "dense"), "NEOPP_CHECKPOINT_NEOPP_MOE": str(tiny / "moe"),
            "NEOPP_CHECKPOINT_NEOPP_MOE_CFG": str(tiny / "moe"), "NEOPP_LORA_DIR": str(tiny / "lora"),
            "NEOPP_BASE_DIR": str(checkout)}


def one_start(repo: Path, log: Path, steps: int) -> dict[str, object]:
    server = TritonServer(repo, env=serve_env(REPO), log_path=log,
                          extra_args=["--model-control-mode=explicit", *KEEP_GOING_ARGS,
                                      *(f"--load-model={m}" for m in MODELS)])
    start = time.monotonic()
    server.start()
    try:
        server.wait_ready(timeout=900)
        ready = time.monotonic() - start
        client = grpcclient.InferenceServerClient(server.grpc_url)
        latencies = {}
        for model in TIMED:
            times = []
            for _ in range(4):
                t0 = time.perf_counter()
                client.infer(model, request_inputs(steps), client_timeout=600)
                times.append(time.perf_counter() - t0)
            latencies[model] = times
        client.close()
    finally:
        server.stop(timeout=60)
    return {"ready": ready, "loads": load_seconds(log.read_text(errors="replace")), "latencies": latencies}


def import_seconds(statement: str) -> float:
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def body(args) -> str:
    if not (TINY / "dense" / "config.json").exists():
        subprocess.run([sys.executable, "-m", "testing.tiny_checkpoint", "--out", str(TINY)], check=True, cwd=REPO)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        repos = {w: repository_copy(Path(tmp), w) for w in (False, True)}
        for r in range(args.rounds):
            for warm in (False, True):
                log = Path(tmp) / f"log_{r}_{warm}.txt"
                try:
                    runs[warm].append(one_start(repos[warm], log, args.steps))
                except TritonLaunchError as exc:  # a server that died while starting: say so, start again
                    failures.append(f"round {r + 1}, warm-up {'on' if warm else 'off'}: {str(exc).splitlines()[0]}")
                    runs[warm].append(one_start(repos[warm], log, args.steps))
    med = statistics.median
    lines = [f"Models of `make serve` (tiny checkpoints), {args.rounds} round(s), each starting the server "
             "without and then with the warm-up; medians over rounds. Requests: default size (1024x1024), "
             f"{args.steps} steps, CFG on.", "",
             "| | warm-up off | warm-up on | on / off |", "|---|---|---|---|"]
    ready = {w: med(x["ready"] for x in runs[w]) for w in runs}
    lines.append(f"| time to ready, 8 models | {ready[False]:.1f} s | {ready[True]:.1f} s | "
                 f"{ready[True] / ready[False]:.2f} |")
    for model in MODELS:
        load = {w: med(x["loads"].get(model, float("nan")) for x in runs[w]) for w in runs}
        lines.append(f"| load {model} | {load[False]:.1f} s | {load[True]:.1f} s | {load[True] / load[False]:.2f} |")
    for model in TIMED:
        first = {w: med(x["latencies"][model][0] for x in runs[w]) for w in runs}
        steady = {w: med(med(x["latencies"][model][1:]) for x in runs[w]) for w in runs}
        lines.append(f"| {model}: first request | {first[False]:.2f} s | {first[True]:.2f} s | "
                     f"{first[True] / first[False]:.2f} |")
        lines.append(f"| {model}: steady (median of requests 2-4) | {steady[False]:.2f} s | {steady[True]:.2f} s | "
                     f"{steady[True] / steady[False]:.2f} |")
        lines.append(f"| {model}: first / steady | {first[False] / steady[False]:.2f} | "
                     f"{first[True] / steady[True]:.2f} | |")
    session, torch_s = import_seconds("import neopp.serving.session_model"), import_seconds("import torch")
    if failures:
        lines += ["", "Starts that failed and were repeated: " + "; ".join(failures)]
    lines += ["", f"Import of the session model's code: {session:.2f} s (it no longer imports torch; "
              f"`import torch` alone: {torch_s:.2f} s, measured beside it)."]
    return "\n".join(lines)


# Run inside another checkout with its own venv: the same start as one_start, time to ready only.
_READY_SCRIPT = """
import sys, time
from pathlib import Path
from neopp.launcher.tritonserver import TritonServer
server = TritonServer(Path.cwd() / "model_repository", log_path=sys.argv[1],
                      extra_args=["--model-control-mode=explicit", *(f"--load-model={m}" for m in sys.argv[2:])])
start = time.monotonic(); server.start(); server.wait_ready(900); print(time.monotonic() - start); server.stop()
"""


def ready_seconds(checkout: Path, log: Path) -> float:
    """Time to ready of ``make serve``'s models started from ``checkout`` (its venv and tiny checkpoints)."""
    done = subprocess.run([str(checkout / ".venv" / "bin" / "python"), "-c", _READY_SCRIPT, str(log), *MODELS],
                          cwd=checkout, env=serve_env(checkout), capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def baseline_body(args) -> str:
    """This checkout against ``--baseline`` (an earlier one), started alternately, ``--rounds`` times."""
    base = Path(args.baseline).resolve()
    times: dict[str, list[float]] = {"baseline": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            times["baseline"].append(ready_seconds(base, Path(tmp) / f"base_{r}.log"))
            times["this"].append(ready_seconds(REPO, Path(tmp) / f"this_{r}.log"))
    med = {k: statistics.median(v) for k, v in times.items()}
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=base, capture_output=True, text=True).stdout
    return (f"Time to ready of the eight models of `make serve` (tiny checkpoints), this checkout against the "
            f"checkout at `{head.strip()}` (each with its own venv), started alternately {args.rounds} times:\n\n"
            "| | baseline | this | this / baseline |\n|---|---|---|---|\n"
            f"| median | {med['baseline']:.1f} s | {med['this']:.1f} s | {med['this'] / med['baseline']:.2f} |\n"
            f"| each | {', '.join(f'{t:.1f}' for t in times['baseline'])} | "
            f"{', '.join(f'{t:.1f}' for t in times['this'])} | |")


def main(argv: list[str] | None = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if "--baseline" in argv:  # python -m bench.startup --baseline DIR [--rounds N] [--out DIR]
        i = argv.index("--baseline")
        baseline, rest = argv[i + 1], argv[:i] + argv[i + 2:]
        section_main(rest, __doc__, "startup_baseline.md", "Start time against an earlier checkout",
                     lambda args: baseline_body(argparse.Namespace(**vars(args), baseline=baseline)), rounds=3)
        return
    section_main(argv, __doc__, "startup.md", "Start time and the first request (warm-up at load)", body,
                 rounds=2, steps=4)


if __name__ == "__main__":
    main()
