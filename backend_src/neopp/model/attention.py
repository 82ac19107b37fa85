"""Attention of the image tokens over prefix + image, and which SDPA kernel runs it.

torch offers several kernels for `scaled_dot_product_attention` (FlashAttention, cuDNN,
memory-efficient, math); which is fastest depends on the card and the shape, and torch's own
pick is a fixed priority list. ``auto`` times every kernel that accepts a shape the first time
the shape is seen (on CUDA, where the choice matters; the CPU keeps torch's pick) and keeps the
fastest for that shape in this process. Each kernel computes the same attention within its
floating-point rounding; a process always uses one kernel per shape, so a request's bytes do
not depend on what else runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger(__name__)

KERNELS: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
SETTINGS = ("auto", "default", *KERNELS)
# Shapes whose key length falls in one bucket of this many positions share a measured choice:
# a kernel's rank does not change within a few hundred keys, and every prompt length differs.
KEY_BUCKET = 256
TIMED_RUNS = 3

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kernel: SDPBackend | None = None) -> torch.Tensor:
    """Unmasked GQA: q [L, NH, HD] over k, v [NKV, S+L, HD] -> [L, NH*HD].

    The query heads that share a KV head are folded into the query length, so keys and
    values are never repeated per head. ``kernel``: the SDPA kernel to use (None: torch's pick).
    """
    tokens, heads, hd = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    qg = q.permute(1, 0, 2).reshape(kv_heads, group * tokens, hd)
    args = (qg.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
    if kernel is None:
        out = F.scaled_dot_product_attention(*args, scale=hd ** -0.5)
    else:
        with sdpa_kernel([kernel]):
            out = F.scaled_dot_product_attention(*args, scale=hd ** -0.5)
    return out.reshape(kv_heads * group, tokens, hd).permute(1, 0, 2).reshape(tokens, heads * hd)


def check_setting(setting: str) -> str:
    setting = (setting or "auto").strip().lower()
    if setting not in SETTINGS:
        raise ValueError(f"attention kernel: one of {', '.join(SETTINGS)}, got {setting!r}")
    return setting


class AttentionKernels:
    """`grouped_attention` with the kernel a setting names, or (``auto``) the fastest per shape."""

    def __init__(self, setting: str = "auto", measure_on_cpu: bool = False) -> None:
        self.setting = check_setting(setting)
        self.measure_on_cpu = measure_on_cpu
        self.chosen: dict[tuple, SDPBackend | None] = {}
        self.timings: dict[tuple, dict[str, float]] = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return grouped_attention(q, k, v, self.kernel_for(q, k, v))

    def kernel_for(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> SDPBackend | None:
        if self.setting == "default":
            return None
        if self.setting != "auto":
            return KERNELS[self.setting]
        if q.device.type != "cuda" and not self.measure_on_cpu:
            return None
        key = self.shape_key(q, k)
        if key not in self.chosen:
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                return None  # never measured inside a capture (graphs capture a shape seen before)
            self.chosen[key] = self._measure(key, q, k, v)
        return self.chosen[key]

    @staticmethod
    def shape_key(q: torch.Tensor, k: torch.Tensor) -> tuple:
        keys = -(-k.shape[1] // KEY_BUCKET) * KEY_BUCKET
        return tuple(q.shape), k.shape[0], keys, q.dtype, q.device.type

    def _measure(self, key: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> SDPBackend | None:
        """Time every kernel that accepts the shape; the fastest wins (None: none ran)."""
        times: dict[str, float] = {}
        for name, kernel in KERNELS.items():
            try:
                times[name] = time_kernel(lambda kernel=kernel: grouped_attention(q, k, v, kernel), q.device)
            except RuntimeError:  # this kernel does not take the shape, dtype or device
                continue
        self.timings[key] = times
        if not times:
            return None
        best = min(times, key=times.__getitem__)
        log.info("attention kernel for q %s, %d keys (bucket of %d), %s: %s (%s)", tuple(q.shape), k.shape[1],
                 KEY_BUCKET, q.dtype, best, ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in times.items()))
        return KERNELS[best]


def time_kernel(run: Callable[[], torch.Tensor], device: torch.device, runs: int = TIMED_RUNS) -> float:
    """Seconds per call after one untimed call (the best of ``runs``: the least disturbed)."""
    run()
    best = float("inf")
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - began)
    return best
