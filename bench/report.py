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
from dataclasses import dataclass
from pathlib import Path

from bench.common import REPO, command_line, machine


@dataclass(frozen=True)
class Section:
    """One benchmark module and the file of the report it writes (``<module>.md`` unless named);
    ``to_file``: its ``--out`` takes that file, not the folder."""

    key: str
    module: str
    title: str
    file: str = ""
    to_file: bool = False

    @property
    def filename(self) -> str:
        return self.file or f"{self.module}.md"

    def args(self, out: Path) -> list[str]:
        return ["--out", str(out / self.filename if self.to_file else out)]


SECTIONS = [
    Section("step_efficiency", "step_efficiency", "Denoising-step efficiency against the machine's matmul rate"),
    Section("scaling", "scaling", "Growth with image and prefix length; memory"),
    Section("cfg", "cfg_bench", "Sequential vs batched vs CFG-parallel guidance", file="cfg.md"),
    Section("cfg_layout", "cfg_layout", "Three-branch guidance on 2 CFG ranks: branch pairing"),
    Section("modes", "modes_bench", "Modes: FP8 memory, step time, MoE dispatch", file="modes.md"),
    Section("lora", "lora_adapters", "LoRA per request: step cost of mixed adapters, adapter memory"),
    Section("step_cache", "step_cache", "Step caches: quality and speed against full compute"),
    Section("kv_ingest", "kv_ingest", "KV ingest: gRPC vs system shared memory", to_file=True),
    Section("http_door", "http_door", "HTTP door: its cost next to the old front and gRPC", to_file=True),
    Section("grpc_front", "grpc_front", "gRPC front: its cost next to gRPC straight to Triton", to_file=True),
    Section("serving", "serving_bench",
            "Triton end to end vs in-process; throughput per instance count", file="serving.md"),
    Section("batched_serving", "batched_serving",
            "Step batching through Triton: batched plain models vs one at a time"),
    Section("fair_share", "fair_share", "Fair share between sizes: small requests beside large ones"),
    Section("startup", "startup", "Start time and the first request (warm-up at load)"),
    Section("prompt_path", "prompt_path", "A prompt to a picture: first sign of life and picture"),
    Section("prompt_encoder", "prompt_encoder", "Prompt encoder at the 8B geometry"),
    Section("serve_memory", "serve_memory", "What each serving profile costs"),
    Section("failover", "failover", "Replicas: a crash under load"),
    Section("8b", "eight_b", "8B geometry"),
    Section("gguf", "gguf_weights", "GGUF weights: memory, layer time, the demo's image"),
    Section("offload_memory", "offload_memory", "GPU memory per tower, weight format and layer offload (computed)"),
    Section("provenance", "provenance", "Provenance: the record and the C2PA signature"),
    Section("demo_quality", "demo_quality",
            "Demo model: what each mode draws, judged on held-out prompts", to_file=True),
    Section("demo_shape_probe", "demo_shape_probe", "Demo model: where the shape is decided", to_file=True),
    Section("demo_train_speed", "demo_train_speed", "Demo model: training throughput"),
]
# Run only when named in --only (`make bench-8b`): it writes and reads a 14 GB checkpoint.
ON_REQUEST = {"8b"}
# Files that need an argument of their own to be made (their command is in them); stitched in when present.
BY_HAND = [("startup_baseline.md", "Start time against an earlier checkout"),
           ("gpu_check.md", "GPU check on one H200 (`make gpu-check`)"),
           ("offload_gpu.md", "Layer offload on a GPU (`make gpu-check`)"),
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
    for section in SECTIONS:
        if (wanted and section.key not in wanted) or (section.key in ON_REQUEST and section.key not in wanted):
            continue
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", f"bench.{section.module}", *section.args(out)], check=True, cwd=REPO)
        timings.append(f"{section.key} {time.monotonic() - start:.0f} s")
    parts = [f"# NeoPP benchmark report\n\nMade by `make bench` (`python -m bench.report --out bench`); "
             f"last assembled on {datetime.date.today().isoformat()} by `{command_line()}`.\n\n"
             f"Machine: {machine()}\n\nEvery comparison below was "
             "measured side by side in one run of its section; sections ran one after the other. Each section "
             "names the command that reproduces it alone."]
    for filename, title in [(s.filename, s.title) for s in SECTIONS] + BY_HAND:
        path = out / filename
        if path.is_file():
            parts.append(f"## {title}\n\n{body_of(path)}")
    if timings:
        parts.append("Section run times of this report: " + ", ".join(timings) + ".")
    (out / "RESULTS.md").write_text("\n\n".join(parts) + "\n")
    print(f"wrote {out / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
