"""Torch's CPU threads belong to the thread that runs the steps.

Torch's CPU kernels run on OpenMP, which keeps a team of worker threads for each thread that
starts parallel work. libgomp lets idle workers spin between parallel regions only while all its
threads fit the cores; past that, every region wakes sleeping workers through the kernel. A step
is thousands of small regions, so a stub that loaded its weights on its main thread (one team)
and steps on the engine's thread (a second team) paid that wake-up on every one: on the demo at
256x256, on 2 cores, a generation took 370 ms on the engine's thread against 200 ms on the
loading thread. Hence:

* the engine is built on a thread that ends once it is built, and its team ends with it;
* the step thread fixes its own thread count before its first step (``own_threads``);
* every other thread of the process (the stub's, which parses requests) then runs torch
  single-threaded, so it never starts a team of its own.

How many threads the step thread gets can be measured at load (``fastest_threads``), since more
is not always faster.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def on_passing_thread(build: Callable[[], T], name: str = "neopp-engine-build") -> T:
    """``build()`` on a thread that ends when it returns (its OpenMP team with it); its result, or
    its exception raised here."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(build())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as it is
            failure.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def own_threads(threads: int) -> None:
    """The calling thread runs torch on ``threads`` threads from now on, whatever the process's
    count becomes. Torch copies the process's count into a thread once, at the thread's first
    question about it (``get_num_threads`` or parallel work), and never again: setting it, then
    asking at once, fixes it for this thread."""
    torch.set_num_threads(threads)
    if torch.get_num_threads() != threads:
        raise RuntimeError(f"torch runs {torch.get_num_threads()} threads here, not {threads}")


def single_threaded_here_on() -> None:
    """The calling thread, and every thread that starts torch work from now on, run torch on one
    thread. A thread that set its own count before (the step thread) keeps it."""
    torch.set_num_threads(1)


def thread_counts(most: int) -> list[int]:
    """The counts worth timing: 1, 2, 4, ... below ``most``, and ``most`` itself."""
    counts, n = [], 1
    while n < most:
        counts.append(n)
        n *= 2
    return [*counts, max(1, most)]


def fastest_threads(run_step: Callable[[], object], most: int, repeats: int = 2, slow_s: float = 2.0,
                    margin: float = 0.1) -> tuple[int, dict[int, float]]:
    """The thread count, up to ``most``, whose ``run_step`` is fastest, and every count's best
    seconds. The counts take turns, one run each per round after an untimed round, so a burst of
    load (other models loading beside this one) falls on all of them alike; fewer threads than
    ``most`` are chosen only when ``margin`` faster.

    More threads are not always faster: a small model's step is thousands of short parallel
    regions, and past a few threads their start-up costs more than the split saves. A step slower
    than ``slow_s`` on ``most`` threads is not timed on fewer (a large model uses them all)."""
    counts = sorted(thread_counts(most), reverse=True)
    timings: dict[int, float] = {}
    for round_ in range(repeats + 1):
        for n in counts:
            torch.set_num_threads(n)
            seconds = _seconds(run_step)
            if round_:
                timings[n] = min(seconds, timings.get(n, seconds))
            elif n == most and seconds > slow_s:
                torch.set_num_threads(most)
                return most, {most: seconds}
    fewer = [n for n in counts if timings[n] < (1 - margin) * timings[most]]
    best = min(fewer, key=timings.__getitem__) if fewer else most
    torch.set_num_threads(best)
    return best, dict(sorted(timings.items()))


def timings_text(timings: dict[int, float]) -> str:
    """``1: 13.1 ms, 2: 8.0 ms``: what a log line says of a measurement."""
    return ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in timings.items())


def _seconds(run: Callable[[], object]) -> float:
    began = time.perf_counter()
    run()
    return time.perf_counter() - began
