"""CUDA graphs of the decoder layers: a step's hundreds of kernel launches become one replay.

A small image's step is bound by the host launching kernels (36 layers x both branches, one by
one); a graph records them once and replays them with one call. A graph bakes in every address
it touches: the branches' prefix buffers and RoPE tables, the input and the output. So a graph
belongs to one set of branches (a request, or a step batch of requests) and one token count,
and it lives while they run:

* the first time a set of branches runs, it runs eagerly (that is the warm-up a capture needs:
  cuBLAS handles, compiled kernels and lazy initialisation happen outside the capture);
* the second time, it is captured; the capture is replayed on the first time's input and must
  give the first time's output byte for byte, or graphs are turned off for the model (logged),
  so a graph can never change a pixel;
* the owner releases a request's graphs when it leaves; at most ``limit`` graphs live.

Nothing is padded: a key holds the exact prefix lengths, so the graph runs the same kernels on
the same shapes as eager and the padded-prefix question does not arise.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# (hidden states, branches) -> hidden states: `NeoPPTransformer.run_layers`.
LayersFn = Callable[[torch.Tensor, object], torch.Tensor]
DEFAULT_LIMIT = 8


def members_of(branches: object) -> tuple[object, ...]:
    """The single branches behind a branch or a batch of them (`BatchedBranches`)."""
    return tuple(getattr(branches, "branches", (branches,)))


@dataclass
class Captured:
    """One graph with its static input and output, and the branches whose buffers it reads
    (held so they outlive it)."""

    graph: torch.cuda.CUDAGraph
    input: torch.Tensor
    output: torch.Tensor
    branches: object


@dataclass
class WarmRun:
    """The eager run of a key's first sighting: the reference its capture must reproduce (the
    branches are held so that their ids, the key, cannot be reused by others meanwhile)."""

    input: torch.Tensor
    output: torch.Tensor
    branches: tuple[object, ...]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (`torch.equal` calls NaN unequal to itself)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


class LayerGraphs:
    """`run_layers` through per-(branches, tokens) CUDA graphs, each checked against eager."""

    def __init__(self, run_layers: LayersFn, device: torch.device, limit: int = DEFAULT_LIMIT) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.run_layers, self.device, self.limit = run_layers, device, limit
        self.graphs: OrderedDict[tuple, Captured] = OrderedDict()
        self.warm: dict[tuple, WarmRun] = {}
        self.enabled = True
        self.replays = self.captures = 0
        # One stream for every warm-up and capture: cuBLAS sets up a workspace per stream, and that
        # must happen in a warm-up, never inside a capture. One pool for every graph: replays run
        # one at a time and each output is copied out at once, so the graphs can share scratch.
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    @staticmethod
    def key(hid: torch.Tensor, branches: object) -> tuple:
        return tuple(id(b) for b in members_of(branches)), tuple(hid.shape), hid.dtype

    def __call__(self, hid: torch.Tensor, branches: object) -> torch.Tensor:
        if not self.enabled or torch.cuda.is_current_stream_capturing():
            return self.run_layers(hid, branches)
        key = self.key(hid, branches)
        captured = self.graphs.get(key)
        if captured is None:
            warm = self.warm.pop(key, None)
            if warm is None or not bool(torch.isfinite(warm.output).all()):  # nothing to check a replay by
                return self._warm_up(key, hid, branches)
            captured = self._capture(key, hid, branches, warm)
            if captured is None:
                return self.run_layers(hid, branches)
        self.graphs.move_to_end(key)
        return self._replay(captured, hid)

    def release(self, branches: Iterable[object]) -> None:
        """Drop every graph and warm-up that reads any of ``branches`` (their request left)."""
        gone = {id(b) for b in branches}
        for table in (self.graphs, self.warm):
            for key in [k for k in table if gone.intersection(k[0])]:
                del table[key]

    def clear(self) -> None:
        self.graphs.clear()
        self.warm.clear()

    # ---- the three stages of a key ------------------------------------------------------
    def _warm_up(self, key: tuple, hid: torch.Tensor, branches: object) -> torch.Tensor:
        """Eager, on the graphs' stream as a capture's warm-up must be; kept as the capture's reference."""
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            out = self.run_layers(hid, branches)
        main.wait_stream(self.stream)
        out.record_stream(main)  # the caller reads it on the main stream
        self.warm[key] = WarmRun(hid.clone(), out.clone(), members_of(branches))
        return out

    def _capture(self, key: tuple, hid: torch.Tensor, branches: object, warm: WarmRun) -> Captured | None:
        """Record the layers once, replay them on the warm-up's input and demand its output's bytes."""
        try:
            captured = self._record(hid, branches)
            captured.input.copy_(warm.input)
            captured.graph.replay()
            same = same_bytes(captured.output, warm.output)
        except torch.OutOfMemoryError:  # this key only: memory may be free again later
            log.warning("CUDA graph of %s not captured: out of memory; those steps run eagerly", key[1])
            return None
        except RuntimeError as exc:  # a kernel that cannot be captured: eager from now on
            cause = exc.__context__ or exc
            self._disable(f"capture failed ({type(cause).__name__}: {cause})")
            return None
        if not same:
            self._disable("a replay differed from the eager run of the same input")
            return None
        self.captures += 1
        self.graphs[key] = captured
        while len(self.graphs) > self.limit:
            self.graphs.popitem(last=False)
        return captured

    def _record(self, hid: torch.Tensor, branches: object) -> Captured:
        """Capture on the graphs' stream without `torch.cuda.graph`'s garbage collection and cache
        flush (costly at every request); `thread_local` lets the server's other threads work. A
        compiled function that would recompile here fails at its guard instead (compiling syncs)."""
        graph = torch.cuda.CUDAGraph()
        static_in = hid.clone()
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream), no_recompiling():
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                static_out = self.run_layers(static_in, branches)
            finally:
                graph.capture_end()
        main.wait_stream(self.stream)
        return Captured(graph, static_in, static_out, branches)

    def _replay(self, captured: Captured, hid: torch.Tensor) -> torch.Tensor:
        captured.input.copy_(hid)
        captured.graph.replay()
        self.replays += 1
        return captured.output.clone()

    def _disable(self, why: str) -> None:
        log.error("CUDA graphs turned off for this model: %s; the layers run eagerly", why)
        self.enabled = False
        self.clear()


def no_recompiling() -> contextlib.AbstractContextManager:
    """torch.compile's stance that fails on a recompile (where this torch has it)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("fail_on_recompile") if set_stance is not None else contextlib.nullcontext()
