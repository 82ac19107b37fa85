"""What every benchmark shares: the machine line, medians, and writing a results file."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"{gpu}, Python {platform.python_version()}")


def load_note() -> str:
    """The machine's load as a report's last line: the reader compares rows of one run only."""
    load = os.getloadavg()
    return (f"Load average while it ran: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min); the "
            "machine is shared, so compare the rows of one run.")


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Wall seconds of `repeats` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out


def stats(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def command_line() -> str:
    script = Path(sys.argv[0]).resolve().with_suffix("")
    module = script.relative_to(REPO) if script.is_relative_to(REPO) else Path(script.name)
    return "python -m " + module.as_posix().replace("/", ".") + \
        ("" if len(sys.argv) == 1 else " " + " ".join(sys.argv[1:]))


def bench_parser(doc: str | None, **int_flags: int) -> argparse.ArgumentParser:
    """The flags of a section module: `--out` (the report folder) and one integer flag per keyword.

    One place, so every section agrees on where reports land when run alone or from bench.report.
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "bench"), help="folder for the report file")
    for name, default in int_flags.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    return parser


def section_main(argv: list[str] | None, doc: str | None, report: str, title: str,
                 body: Callable[[argparse.Namespace], str], **int_flags: int) -> Path:
    """The whole `main` of a section module: parse its flags, measure, write `<out>/<report>`."""
    args = bench_parser(doc, **int_flags).parse_args(argv)
    return write_report(Path(args.out) / report, title, body(args))


def write_report(path: Path, title: str, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = f"# {title}\n\nCommand: `{command_line()}`\n\nMachine: {machine()}\n\n{body}\n"
    path.write_text(text)
    print(text)
    return path


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Highest RSS seen while the block runs (sampled every millisecond in a thread)."""

    def __enter__(self) -> PeakRSS:
        import threading

        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def save_figure(fig: Any, path: Path, title: str | None = None) -> None:
    """Title, tight layout, a 100-dpi PNG, and the figure closed (pyplot keeps it otherwise)."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
