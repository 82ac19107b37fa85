"""Per-request step caches inside step batching: reuse the tower's residual on steps that change little.

Each (request, guidance branch) keeps its own state and decides at each step, from that state alone,
whether the decoder layers run or their residual (what the layers add to their input) is reused;
so a request's bytes never depend on who shares its batch. Requests with ``cache`` off take the
uncached path, with the same bytes as without this module.

* ``fbcache`` (first-block cache): the first decoder layer always runs; when its residual moved
  less than ``threshold`` (relative L1) since the last step that ran the whole tower, the other
  layers are skipped and their residual from that step is added instead.
* ``taylorseer`` (forecast, decided before the tower): the relative L1 change of the tower's input
  is summed over steps (TeaCache's indicator, unscaled); while the sum stays under ``threshold`` the
  tower is skipped entirely and its residual is forecast to first order (TaylorSeer) from the last
  two computed steps. A skipping request costs no layer work at all that step.

Both always compute the first step, the last step and after ``MAX_REUSE`` reuses in a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..model.adapters import Adapter, RowGroup
from ..model.transformer import BatchedBranches, BranchContext
from ..modes import SamplingParams

if TYPE_CHECKING:  # the pipeline imports this module (its checks)
    from .pipeline import NeoPPPipeline, Prepared

# Thresholds chosen from bench/step_cache.md (the demo model at 50 steps).
DEFAULT_THRESHOLDS = {"fbcache": 0.05, "taylorseer": 0.12}
MAX_REUSE = 3        # reused steps in a row at most: the stale residual's error grows with each
PROBE_LAYERS = 1     # fbcache: the layers that always run and whose residual decides


@dataclass
class BranchState:
    """What one branch of one request remembers between steps."""

    probe: torch.Tensor | None = None      # fbcache: first-layer residual; taylorseer: the last tower input
    residual: torch.Tensor | None = None   # what the skipped layers added at the last computed step
    slope: torch.Tensor | None = None      # taylorseer: the residual's change per step
    computed_at: int = -1
    drift: float = 0.0                     # taylorseer: relative input change summed since then
    reused: int = 0                        # reuses in a row


@dataclass
class RequestCache:
    """A request's cache: its method, threshold, per-branch state and what it saved."""

    method: str
    threshold: float
    steps: int
    branches: dict[str, BranchState] = field(default_factory=dict)
    computed: int = 0   # branch passes that ran the whole tower
    reused: int = 0     # branch passes answered from the cache
    embedded: tuple[int, torch.Tensor] | None = None  # (step, tower input) the cost check embedded

    def tower_input(self, pipe: NeoPPPipeline, x: torch.Tensor, prep: Prepared, k: int) -> torch.Tensor:
        """Step k's tower input, embedded once per step (the scheduler's cost check and the step
        both need it)."""
        if self.embedded is None or self.embedded[0] != k:
            self.embedded = (k, pipe.embed(x, prep, k))
        return self.embedded[1]

    def state(self, name: str) -> BranchState:
        return self.branches.setdefault(name, BranchState())

    def must_compute(self, st: BranchState, k: int) -> bool:
        return st.residual is None or k == self.steps - 1 or st.reused >= MAX_REUSE


def new_cache(sampling: SamplingParams) -> RequestCache | None:
    """The cache state of a request that asked for one (None: ``off``)."""
    if sampling.cache == "off":
        return None
    threshold = sampling.cache_threshold
    return RequestCache(sampling.cache, DEFAULT_THRESHOLDS[sampling.cache] if threshold is None else threshold,
                        sampling.infer_steps)


def rel_l1(new: torch.Tensor, old: torch.Tensor) -> float:
    """mean |new - old| / mean |old|, in float32 (the indicator both methods threshold)."""
    old32 = old.float()
    return float((new.float() - old32).abs().mean() / old32.abs().mean().clamp_min(1e-12))


@dataclass
class Row:
    """One (request, branch) of a step: its cache (None: off), branch name, step, tower input, and
    its LoRA adapter with its scale (None: the base weights)."""

    cache: RequestCache | None
    name: str
    k: int
    hid: torch.Tensor
    branch: BranchContext
    adapter: Adapter | None = None
    lora_scale: float = 1.0


def run_tower(pipe: NeoPPPipeline, rows: list[Row]) -> list[torch.Tensor]:
    """The final hidden states of every row: uncached and computing rows run the layers together,
    ``fbcache`` rows run the first layer, then the rest only where the residual moved."""
    out: list[torch.Tensor | None] = [None] * len(rows)
    full, probe = [], []
    for r, row in enumerate(rows):
        if row.cache is None:
            full.append(r)
        elif row.cache.method == "fbcache":
            probe.append(r)
        elif (forecast := _taylor_forecast(row)) is not None:
            out[r] = forecast
        else:
            full.append(r)
    for r, h in zip(full, _layers(pipe, rows, full, None)):
        out[r] = h
        if rows[r].cache is not None:
            _taylor_computed(rows[r], h)
    if probe:
        _first_block(pipe, rows, probe, out)
    return out  # type: ignore[return-value]


def _layers(pipe: NeoPPPipeline, rows: list[Row], idx: list[int], layers: range | None,
            inputs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Run ``layers`` (None: all, through the pipeline's graphs) over rows ``idx`` in one batch."""
    if not idx:
        return []
    hids = inputs if inputs is not None else [rows[r].hid for r in idx]
    branches = BatchedBranches([rows[r].branch for r in idx])
    groups, start = [], 0
    for r, h in zip(idx, hids):  # each adapter on its own rows, as in an uncached step
        if rows[r].adapter is not None:
            groups.append(RowGroup(start, start + h.shape[0], rows[r].adapter, rows[r].lora_scale))
        start += h.shape[0]
    hidden = pipe.run_layers(torch.cat(hids), branches, tuple(groups), layers)
    return list(hidden.split([h.shape[0] for h in hids]))


@torch.inference_mode()
def skipping_branches(pipe: NeoPPPipeline, cache: RequestCache | None, x: torch.Tensor, prep: Prepared,
                      k: int) -> int:
    """How many of step k's branches will skip the tower (``taylorseer`` decides before it), read
    without changing the state: the scheduler's cost of a request that reuses is nothing."""
    if cache is None or cache.method != "taylorseer":
        return 0
    hid = cache.tower_input(pipe, x, prep, k)
    states = [cache.branches.get(name) for name in pipe.step_branch_names(prep, k)]
    return sum(st is not None and _taylor_skips(cache, st, hid, k) for st in states)


def _taylor_skips(cache: RequestCache, st: BranchState, hid: torch.Tensor, k: int) -> bool:
    """The decision for tower input ``hid`` at step k, without noting it."""
    drift = st.drift + (rel_l1(hid, st.probe) if st.probe is not None else 0.0)
    return not cache.must_compute(st, k) and drift < cache.threshold


def _taylor_forecast(row: Row) -> torch.Tensor | None:
    """The forecast hidden states if this row may skip the tower, else None (it computes)."""
    cache, st = row.cache, row.cache.state(row.name)
    skips = _taylor_skips(cache, st, row.hid, row.k)
    if st.probe is not None:
        st.drift += rel_l1(row.hid, st.probe)
    st.probe = row.hid
    if not skips:
        return None
    st.reused += 1
    cache.reused += 1
    residual = st.residual.float()
    if st.slope is not None:
        residual = residual + (row.k - st.computed_at) * st.slope
    return (row.hid.float() + residual).to(row.hid.dtype)


def _taylor_computed(row: Row, hidden: torch.Tensor) -> None:
    """Note a computed step: the new residual and its slope since the previous computed step."""
    cache, st = row.cache, row.cache.state(row.name)
    residual = (hidden.float() - row.hid.float())
    if st.residual is not None:
        st.slope = (residual - st.residual.float()) / (row.k - st.computed_at)
    st.residual, st.computed_at, st.drift, st.reused = residual, row.k, 0.0, 0
    cache.computed += 1


def _first_block(pipe: NeoPPPipeline, rows: list[Row], probe: list[int], out: list[torch.Tensor | None]) -> None:
    """fbcache rows: the first layer for all, then the rest only for the rows that moved."""
    depth = len(pipe.transformer.layers)
    first = _layers(pipe, rows, probe, range(PROBE_LAYERS))
    rest: list[int] = []
    for r, h in zip(probe, first):
        row = rows[r]
        cache, st = row.cache, row.cache.state(row.name)
        moved = h.float() - row.hid.float()
        if not cache.must_compute(st, row.k) and rel_l1(moved, st.probe) < cache.threshold:
            st.reused += 1
            cache.reused += 1
            out[r] = (h.float() + st.residual).to(h.dtype)
        else:
            st.probe = moved
            rest.append(r)
    firsts = dict(zip(probe, first))
    for r, h in zip(rest, _layers(pipe, rows, rest, range(PROBE_LAYERS, depth), [firsts[r] for r in rest])):
        row = rows[r]
        st = row.cache.state(row.name)
        st.residual, st.computed_at, st.reused = h.float() - firsts[r].float(), row.k, 0
        row.cache.computed += 1
        out[r] = h
