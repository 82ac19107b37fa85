"""Tritonserver's log on a host without GPUs: the options that fit it, and one line relabelled.

The wheel's tritonserver is a GPU build. On a machine without an NVIDIA driver it would log
an error and two warnings at every start that say nothing about the service: GPU metrics
(``Error: Failed to initialize NVML``, DCGM) and the pinned-memory pool. Server options turn
those off (``cpu_only_args``). Two lines have no option: the CUDA block manager, which every GPU
build creates at start, logs ``CudaDriverHelper has not been initialized.`` at error level
and carries on, and the Python backend asks for pinned memory once per BLS model and warns
that there is none. ``LogRelay`` copies the server's output and, on such a host only, writes
those lines at info level with the reason, so that an error line in the log always means an
error.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

NVIDIA_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl")
# Set by us only where the build cannot avoid them: flag name -> value on a host without GPUs.
CPU_ONLY_OPTIONS = {"--allow-gpu-metrics": "false", "--pinned-memory-pool-byte-size": "0"}
# Triton's glog prefix: severity letter, date, time, thread, file:line.
_GLOG = re.compile(rb"^[EW]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] ")
CPU_ONLY_LINES = {  # text in the line -> why it is expected
    b"CudaDriverHelper has not been initialized.": b"Triton's CUDA block manager is off",
    b"no pinned memory pool, falling back to non-pinned": b"no pinned memory without a GPU",
}


def nvidia_driver_present() -> bool:
    """True when the host has an NVIDIA kernel driver (cheap: no CUDA call, no library load)."""
    return any(Path(p).exists() for p in NVIDIA_DRIVER_FILES)


def cpu_only_args(extra_args: list[str]) -> list[str]:
    """The CPU-only options the caller's own arguments do not set already."""
    return [f"{flag}={value}" for flag, value in CPU_ONLY_OPTIONS.items()
            if not any(a == flag or a.startswith(flag + "=") for a in extra_args)]


def relabel(line: bytes) -> bytes:
    """An expected CPU-only error or warning at info level, with the reason; other lines unchanged."""
    if _GLOG.match(line) is None:
        return line
    for text, why in CPU_ONLY_LINES.items():
        if text in line:
            return b"I" + line.rstrip(b"\n")[1:] + b" (expected without an NVIDIA driver: " + why + b")\n"
    return line


class LogRelay:
    """Copies the server's output (a pipe) line by line to ``sink``, relabelling when asked, and
    hands each line to ``on_line``. Its thread ends when every writer (the server and its stubs)
    has closed the pipe.
    """

    def __init__(self, source: IO[bytes], sink: IO[bytes], relabel_cpu_only: bool,
                 on_line: Callable[[bytes], None] | None = None) -> None:
        self._source, self._sink, self._relabel, self._on_line = source, sink, relabel_cpu_only, on_line
        self._write_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tritonserver-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self._source:
            for line in iter(self._source.readline, b""):
                self._write(relabel(line) if self._relabel else line)
                if self._on_line is not None:
                    self._on_line(line)

    def note(self, text: str) -> None:
        """A line of our own in the server's log."""
        self._write(text.encode() + b"\n")

    def _write(self, data: bytes) -> None:
        with self._write_lock:
            try:
                self._sink.write(data)
                self._sink.flush()
            except (OSError, ValueError):  # the sink was closed: keep draining the pipe
                pass

    def join(self, timeout: float = 10.0) -> bool:
        """Waits for the end of the server's output; False if it is still open after ``timeout``."""
        self._thread.join(timeout)
        return not self._thread.is_alive()
