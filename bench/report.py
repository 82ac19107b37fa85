"""`make bench`: run every benchmark one after the other and collect them in bench/RESULTS.md.

    python -m bench.report [--out bench] [--only step_efficiency,cfg]

Each section is its own module (runnable alone, writing its own file with its exact command);
they run sequentially in child processes so no two measurements share the machine, and this
report stitches their files together under one header with the machine and the date.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, command_line, machine

# (key, module, arguments given the output folder, file it writes, title)
SECTIONS = [
    ("step_efficiency", "step_efficiency", lambda out: ["--out", out], "step_efficiency.md",
     "Denoising-step efficiency against the machine's matmul rate"),
    ("scaling", "scaling", lambda out: ["--out", out], "scaling.md", "Growth with image and prefix length; memory"),
    ("cfg", "cfg_bench", lambda out: ["--out", out], "cfg.md", "Sequential vs batched vs CFG-parallel guidance"),
    ("cfg_layout", "cfg_layout", lambda out: ["--out", out], "cfg_layout.md",
     "Three-branch guidance on 2 CFG ranks: branch pairing"),
    ("modes", "modes_bench", lambda out: ["--out", out], "modes.md", "Modes: FP8 memory, step time, MoE dispatch"),
    ("lora", "lora_adapters", lambda out: ["--out", out], "lora_adapters.md",
     "LoRA per request: step cost of mixed adapters, adapter memory"),
    ("step_cache", "step_cache", lambda out: ["--out", out], "step_cache.md",
     "Step caches: quality and speed against full compute"),
    ("kv_ingest", "kv_ingest", lambda out: ["--out", str(Path(out) / "kv_ingest.md")], "kv_ingest.md",
     "KV ingest: gRPC vs system shared memory"),
    ("http_door", "http_door", lambda out: ["--out", str(Path(out) / "http_door.md")], "http_door.md",
     "HTTP door: its cost next to the old front and gRPC"),
    ("grpc_front", "grpc_front", lambda out: ["--out", str(Path(out) / "grpc_front.md")], "grpc_front.md",
     "gRPC front: its cost next to gRPC straight to Triton"),
    ("serving", "serving_bench", lambda out: ["--out", out], "serving.md",
     "Triton end to end vs in-process; throughput per instance count"),
    ("batched_serving", "batched_serving", lambda out: ["--out", out], "batched_serving.md",
     "Step batching through Triton: batched plain models vs one at a time"),
    ("startup", "startup", lambda out: ["--out", out], "startup.md",
     "Start time and the first request (warm-up at load)"),
    ("prompt_path", "prompt_path", lambda out: ["--out", out], "prompt_path.md",
     "A prompt to a picture: first sign of life and picture"),
    ("prompt_encoder", "prompt_encoder", lambda out: ["--out", out], "prompt_encoder.md",
     "Prompt encoder at the 8B geometry"),
    ("serve_memory", "serve_memory", lambda out: ["--out", out], "serve_memory.md",
     "What each serving profile costs"),
    ("failover", "failover", lambda out: ["--out", out], "failover.md", "Replicas: a crash under load"),
    ("8b", "eight_b", lambda out: ["--out", out], "eight_b.md", "8B geometry"),
    ("demo_quality", "demo_quality", lambda out: ["--out", str(Path(out) / "demo_quality.md")], "demo_quality.md",
     "Demo model: what each mode draws, judged on held-out prompts"),
    ("demo_shape_probe", "demo_shape_probe", lambda out: ["--out", str(Path(out) / "demo_shape_probe.md")],
     "demo_shape_probe.md", "Demo model: where the shape is decided"),
    ("demo_train_speed", "demo_train_speed", lambda out: ["--out", out], "demo_train_speed.md",
     "Demo model: training throughput"),
]
# Run only when named in --only (`make bench-8b`): it writes and reads a 14 GB checkpoint.
ON_REQUEST = {"8b"}
# Files that need an argument of their own to be made (their command is in them); stitched in when present.
BY_HAND = [("startup_baseline.md", "Start time against an earlier checkout"),
           ("gpu_check.md", "GPU check on one H200 (`make gpu-check`)"),
           ("continuous_batching_gpu.md", "Continuous batching on one H200: one engine vs one and two plain instances")]


def body_of(path: Path) -> str:
    """A section file without its own title (its command and machine lines stay), its headings one
    level down so that they stay inside the section."""
    lines = path.read_text().splitlines()
    lines = lines[1:] if lines and lines[0].startswith("# ") else lines
    return "\n".join("#" + line if line.startswith("##") else line for line in lines).strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "bench"))
    parser.add_argument("--only", default="", help="comma-separated section keys to (re)run; others are reused")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = {k for k in args.only.split(",") if k}
    timings = []
    for key, module, make_args, _, _ in SECTIONS:
        if (wanted and key not in wanted) or (key in ON_REQUEST and key not in wanted):
            continue
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", f"bench.{module}", *make_args(str(out))], check=True, cwd=REPO)
        timings.append(f"{key} {time.monotonic() - start:.0f} s")
    parts = [f"# NeoPP benchmark report\n\nMade by `make bench` (`python -m bench.report --out bench`); "
             f"last assembled on {datetime.date.today().isoformat()} by `{command_line()}`.\n\n"
             f"Machine: {machine()}\n\nEvery comparison below was "
             "measured side by side in one run of its section; sections ran one after the other. Each section "
             "names the command that reproduces it alone."]
    for filename, title in [(f, t) for _k, _m, _a, f, t in SECTIONS] + BY_HAND:
        path = out / filename
        if path.is_file():
            parts.append(f"## {title}\n\n{body_of(path)}")
    if timings:
        parts.append("Section run times of this report: " + ", ".join(timings) + ".")
    (out / "RESULTS.md").write_text("\n\n".join(parts) + "\n")
    print(f"wrote {out / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
