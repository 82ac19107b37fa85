"""Layer offload: a tower's decoder layers held in pinned host memory and brought to the GPU a
few at a time, so a checkpoint larger than the card still serves.

Policies (a mode file's ``offload`` key, or a model's ``offload`` parameter):

* ``none``: every layer stays on the device (no offload object at all);
* ``low``: one layer's weights on the device. Layer i+1 is copied in once layer i has run, so
  every step pays its copies on top of its compute: the least memory;
* ``balanced``: three layers' weights on the device. While layer i runs, layers i+1 and i+2 are
  copied on a stream of their own, so the copies overlap the compute.

The device holds a ring of slots (one per resident layer). A copy into a slot waits on an event
recorded after the slot's previous layer ran; a layer runs only after an event recorded after its
copy. So a weight is never read before it arrived, nor overwritten while read.

A layer's objects are never replaced: each of its tensors has its storage pointed (``Tensor.data``)
at the slot while the layer runs and back at its host copy afterwards. Whatever is keyed by a
layer's linears (per-request adapters), compiled layer functions and the MoE experts' stacked
views keep working on the same objects.

On a CPU there is nothing to offload to, and :func:`layer_offload` refuses it. The class itself
runs on the CPU as a stand-in (copies are plain, events are not needed), which is how the tests
check its bytes and its ring.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError
from ..modes import OFFLOAD_POLICIES

AHEAD = {"low": 0, "balanced": 2}  # layers copied ahead of the running one


def check_policy(policy: str) -> str:
    if policy not in OFFLOAD_POLICIES:
        raise ConfigError(f"offload: one of {', '.join(OFFLOAD_POLICIES)}, got {policy!r}")
    return policy


def layer_offload(policy: str, device: torch.device) -> LayerOffload | None:
    """The offload a model runs with: None for ``none``; refused on anything but a CUDA device."""
    if check_policy(policy) == "none":
        return None
    if device.type != "cuda":
        raise ConfigError(f"offload: {policy!r} needs a CUDA device; the model runs on {device}, "
                          "where the weights already are in host memory (use none)")
    return LayerOffload(policy, device)


def layer_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor a layer object holds, through this package's objects, lists, tuples and dicts."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            found.setdefault(id(x), x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
        elif isinstance(x, dict):
            for y in x.values():
                visit(y)
        elif type(x).__module__.startswith("neopp.") and id(x) not in seen:
            seen.add(id(x))
            for y in getattr(x, "__dict__", {}).values():
                visit(y)

    visit(obj)
    return list(found.values())


ALIGN = 256  # bytes: where each tensor of a layer starts in its flat buffer (what GPU kernels like)


def span_bytes(t: torch.Tensor) -> int:
    """Bytes from a dense tensor's first element to its last, by its strides."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def carve(flat: torch.Tensor, place: tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]) -> torch.Tensor:
    """The tensor at ``place`` (byte offset, dtype, size, stride) inside a flat byte buffer."""
    offset, dtype, size, stride = place
    with torch.inference_mode(False):
        out = torch.empty(0, dtype=dtype, device=flat.device)
        return out.set_(flat.untyped_storage(), offset // out.element_size(), size, stride)


def pinned_bytes(n: int) -> torch.Tensor:
    """``n`` bytes of page-locked host memory, exactly: torch's pinned allocator rounds each block up
    to a power of two (an 8B layer's 0.39 GB would take 0.54). Registered with CUDA; where this
    torch has no binding for that, through the allocator."""
    flat = torch.empty(n, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    if n == 0 or not hasattr(cudart, "cudaHostRegister"):
        return flat if n == 0 else torch.empty(n, dtype=torch.uint8, pin_memory=True)
    code = int(cudart.cudaHostRegister(flat.data_ptr(), n, 0))
    if code != 0:
        raise ConfigError(f"offload: could not pin {n} bytes of host memory for a layer (CUDA error {code}); "
                          "the host needs the tower's layers in locked memory (see the container's memlock limit)")
    weakref.finalize(flat, cudart.cudaHostUnregister, flat.data_ptr())
    return flat


@dataclass
class HeldLayer:
    """One layer's tensors: those that own their storage (``bases``), laid out in one flat byte
    buffer on the host (``flat``; each base at its ``places`` entry), and the views into them (the
    MoE experts' weights in their stacks), rebuilt over whichever storage the bases point at."""

    bases: list[torch.Tensor]
    places: list[tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]]
    views: list[tuple[torch.Tensor, int, tuple[int, ...], tuple[int, ...], int]]  # view, base, size, stride, offset
    flat: torch.Tensor
    host: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return self.flat.numel()

    def point_to(self, storage: Sequence[torch.Tensor]) -> None:
        for tensor, target in zip(self.bases, storage, strict=True):
            tensor.data = target
        for view, base, size, stride, offset in self.views:
            target = storage[base]
            view.data = target.as_strided(size, stride, target.storage_offset() + offset)


@dataclass
class Slot:
    """Room on the device for one layer (a flat byte buffer as large as the largest layer), the
    layers' tensors carved from it, and the events that order its copies against its use."""

    flat: torch.Tensor | None = None
    carved: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # by layer index
    ready: Any = None  # torch.cuda.Event: the copy in has finished
    free: Any = None   # torch.cuda.Event: the layer it held last has run


class LayerOffload:
    """The layers of one tower, on the host; :meth:`each` brings them in as a loop reaches them."""

    def __init__(self, policy: str, device: torch.device) -> None:
        if check_policy(policy) == "none":
            raise ConfigError("offload: 'none' runs without an offload")
        self.policy, self.device = policy, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.layers: list[HeldLayer] = []
        self.slots = [self._slot() for _ in range(AHEAD[policy] + 1)]
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._turn = 0
        self._bound: tuple[object, int, Slot] | None = None  # (the loop, its layer, the slot)

    def _slot(self) -> Slot:
        if not self.cuda:
            return Slot()
        return Slot(ready=torch.cuda.Event(), free=torch.cuda.Event())

    # ---- holding ------------------------------------------------------------------------------
    def adopt(self, layer: Any) -> None:
        """Take the next layer of the tower: its tensors move to host memory (pinned on CUDA) and
        the device copies it was built with are freed, so a tower loads one layer at a time."""
        tensors = layer_tensors(layer)
        ids = {id(t) for t in tensors}
        owners = {id(t) for t in tensors if t._base is None or id(t._base) not in ids}
        bases = [t for t in tensors if id(t) in owners]
        index = {id(t): i for i, t in enumerate(bases)}
        views = [(t, index[id(t._base)], tuple(t.shape), t.stride(), t.storage_offset() - t._base.storage_offset())
                 for t in tensors if id(t) not in owners]
        places, end = [], 0
        for t in bases:
            dense = t.is_contiguous() or span_bytes(t) == t.numel() * t.element_size()
            if not dense and any(v[1] == index[id(t)] for v in views):
                raise ConfigError(f"offload: a layer tensor of shape {tuple(t.shape)} has gaps and views into it")
            stride = t.stride() if dense else torch.empty(t.shape).stride()  # a gapped one is held packed
            start = -(-end // ALIGN) * ALIGN
            places.append((start, t.dtype, tuple(t.shape), stride))
            end = start + (span_bytes(t) if dense else t.numel() * t.element_size())
        with torch.inference_mode(False):
            flat = pinned_bytes(end) if self.cuda else torch.empty(end, dtype=torch.uint8)
            host = [carve(flat, place) for place in places]
            for h, t in zip(host, bases, strict=True):
                h.copy_(t.detach())
        held = HeldLayer(bases, places, views, flat, host)
        held.point_to(host)
        self.layers.append(held)

    @property
    def host_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def ring(self) -> list[Slot]:
        """The slots in use: no more than the tower has layers."""
        return self.slots[:max(1, min(len(self.slots), len(self.layers)))]

    @property
    def device_bytes(self) -> int:
        """What the slots hold on the device: at most this many of the largest layer's bytes."""
        return sum(slot.flat.numel() for slot in self.slots if slot.flat is not None)

    # ---- streaming ----------------------------------------------------------------------------
    def each(self, indices: Iterable[int]) -> Iterator[int]:
        """Yield each index once its layer's weights are on the device; when the loop body has
        queued the layer's work, its weights point back at the host and its slot takes a later
        layer. One loop at a time (a tower runs on one thread); a loop left without being closed
        has its layer taken back by the next one, and its own late cleanup touches nothing."""
        self._unbind()
        loop = object()
        order = list(indices)
        pending: deque[tuple[int, Slot]] = deque()
        loaded = 0
        while True:
            while loaded < len(order) and len(pending) < len(self.ring):
                pending.append((order[loaded], self._load(order[loaded])))
                loaded += 1
            if not pending:
                return
            index, slot = pending.popleft()
            self._bind(loop, index, slot)
            try:
                yield index
            finally:
                self._unbind(loop)

    def _load(self, index: int) -> Slot:
        ring = self.ring
        slot = ring[self._turn % len(ring)]
        self._turn += 1
        held = self.layers[index]
        if self.copy_stream is None:
            self._fill(slot, held, non_blocking=False)
        else:
            self.copy_stream.wait_event(slot.free)  # the layer it held last has run
            with torch.cuda.stream(self.copy_stream):
                self._fill(slot, held, non_blocking=True)
                slot.ready.record(self.copy_stream)
        return slot

    def _fill(self, slot: Slot, held: HeldLayer, non_blocking: bool) -> None:
        if slot.flat is None:  # once: as large as the largest layer, so no layer reallocates it
            with torch.inference_mode(False):
                slot.flat = torch.empty(max(layer.nbytes for layer in self.layers), dtype=torch.uint8,
                                        device=self.device)
        slot.flat[:held.nbytes].copy_(held.flat, non_blocking=non_blocking)

    def _bind(self, loop: object, index: int, slot: Slot) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(slot.ready)
        held = self.layers[index]
        if index not in slot.carved:
            slot.carved[index] = [carve(slot.flat, place) for place in held.places]
        held.point_to(slot.carved[index])
        self._bound = (loop, index, slot)

    def _unbind(self, loop: object | None = None) -> None:
        """Point the bound layer back at the host (``loop``: only if that loop bound it)."""
        if self._bound is None or (loop is not None and self._bound[0] is not loop):
            return
        _, index, slot = self._bound
        if self.cuda:
            slot.free.record(torch.cuda.current_stream(self.device))
        self.layers[index].point_to(self.layers[index].host)
        self._bound = None


def streamed(layers: Sequence[Any], offload: LayerOffload | None,
             indices: Iterable[int] | None = None) -> Iterator[tuple[int, Any]]:
    """(index, layer) over ``indices`` (default: all), each layer's weights on the device while
    the loop body runs it."""
    order = range(len(layers)) if indices is None else indices
    if offload is None:
        for i in order:
            yield i, layers[i]
    else:
        for i in offload.each(order):
            yield i, layers[i]
