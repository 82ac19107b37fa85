"""Building blocks of one decoder layer: norms, linears, attention over prefix + image, MLPs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .checkpoint_config import DEFAULT_RMS_NORM_EPS
from .kernel_choices import check_moe_dispatch, kernel_choices


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = DEFAULT_RMS_NORM_EPS) -> torch.Tensor:
    """RMSNorm: float32 statistics, cast back to the input dtype, then the weight (in that order).

    `eps` is the checkpoint's `llm_config.rms_norm_eps`, shared by every norm of the tower.
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


# CPU GEMMs run over token rows in tiles of exactly kernel_choices().row_tile rows (the last one
# zero-padded): a row's result then depends on that row alone, and a request batched with others
# gets the same bytes as alone. Measured cost on 2 cores: a 4-layer width-1024 float32 tower
# generates 15% (256x256) to 33% (512x512) slower. `NEOPP_ROW_TILE=0` in the server's environment
# runs whole products instead (batched images then match solo ones within float reassociation only).
_tile_override: int | None = None  # row_tiles' choice for a block (training), over the environment's


def row_tile() -> int:
    return kernel_choices().row_tile if _tile_override is None else _tile_override


@contextmanager
def row_tiles(rows: int) -> Iterator[None]:
    """Run CPU products in tiles of `rows` (0: whole) inside the block; training, which needs no
    batch invariance, takes whole products (24% faster on the demo tower)."""
    global _tile_override
    before, _tile_override = _tile_override, rows
    try:
        yield
    finally:
        _tile_override = before


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, batch-invariant per row on the CPU (see row_tile); GPUs take one call."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    tile = row_tile() if x.device.type == "cpu" else 0
    if rows == 0 or tile <= 0:
        return F.linear(x, weight, bias)
    tiles = list(x.reshape(rows, x.shape[-1]).split(tile))
    pad = -rows % tile
    if pad:  # only the last tile is copied to pad it
        tiles[-1] = torch.cat([tiles[-1], tiles[-1].new_zeros(pad, x.shape[-1])])
    out = torch.cat([F.linear(tile, weight, bias) for tile in tiles])
    return out[:rows].reshape(*x.shape[:-1], weight.shape[0])


# The LoRA row groups of the step running in this context (``neopp.model.adapters.RowGroup``:
# start, stop, adapter, scale); empty outside a step that carries an adapter.
ROW_ADAPTERS: ContextVar[tuple] = ContextVar("neopp_row_adapters", default=())


def adapters_active() -> bool:
    """Do row groups apply here? Never inside a compiled layer: those run only steps without an
    adapter, and tracing the context variable would break the compiled graph at every linear."""
    return not torch.compiler.is_compiling() and bool(ROW_ADAPTERS.get())


def add_adapter_rows(linear: object, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` (the base projection of ``x``) plus each active group's low-rank delta on its own rows:
    ``scale * (alpha / rank) * (x[rows] A^T) B^T``, tiled as the base product (batch-invariant)."""
    for g in ROW_ADAPTERS.get():
        f = g.adapter.factors.get(linear)
        if f is None:
            continue
        if x.dim() != 2 or (g.stop is not None and x.shape[0] < g.stop):
            raise ConfigError(f"LORA: adapter {g.adapter.name!r} targets a linear that ran on {tuple(x.shape)}, "
                              "not on the batch's rows (a routed expert); adapters apply to whole-batch linears only")
        delta = linear_rows(linear_rows(x[g.start:g.stop], f.down), f.up)
        y[g.start:g.stop] += delta * (g.scale * f.factor)
    return y


class Linear:
    """`y = x W^T + b` with a full-precision weight; quantised variants share this call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = linear_rows(x, self.weight, self.bias)
        return add_adapter_rows(self, x, y) if adapters_active() else y

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias) if t is not None)


class SwiGLU:
    def __init__(self, gate: Linear, up: Linear, down: Linear) -> None:
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))

    def linears(self) -> list[Linear]:
        return [self.gate, self.up, self.down]


# How the experts run (kernel_choices().moe_dispatch): "loop" (one product per expert, the CPU
# default: its products are batch-invariant row tiles, so step-batched requests equal solo ones),
# "grouped" (one grouped product per projection over all experts, no host sync: the CUDA
# default), or "auto".


class GroupedExperts:
    """The experts' projections stacked [experts, out, in], run as one grouped product each
    (``torch._grouped_mm``) over the tokens sorted by expert. The experts' own linears become
    views into the stacks, so the weights are held once."""

    def __init__(self, experts: list[SwiGLU]) -> None:
        self.stacks = []
        for name in ("gate", "up", "down"):
            stack = torch.stack([getattr(e, name).weight for e in experts])
            for e, weight in zip(experts, stack):
                getattr(e, name).weight = weight
            self.stacks.append(stack)

    @staticmethod
    def fits(experts: list[SwiGLU]) -> bool:
        """Plain unbiased linears of one shape set, dtype and device, rows 16-byte aligned (what the
        grouped product needs); anything else (FP8 experts) keeps the loop."""
        first = experts[0].linears()
        w = first[0].weight
        return all(type(lin) is Linear and lin.bias is None and lin.weight.dtype == w.dtype
                   and lin.weight.device == w.device and lin.weight.shape == ref.weight.shape
                   for e in experts for lin, ref in zip(e.linears(), first)) \
            and w.dtype in (torch.float32, torch.bfloat16) \
            and all(side * w.element_size() % 16 == 0 for lin in first for side in lin.weight.shape)

    @property
    def reads_host_values(self) -> bool:
        """Does the grouped product copy the group ends to the host? Its fused kernel (bf16 on
        compute capability 9.x or 10.x) does not; its fallback loops over the groups on the host."""
        w = self.stacks[0]
        if not w.is_cuda:
            return True
        return w.dtype != torch.bfloat16 or torch.cuda.get_device_capability(w.device)[0] not in (9, 10)

    def __call__(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``x_sorted`` [tokens x top-k, in] grouped by expert; ``offsets``: each group's end."""
        gate, up, down = (s.transpose(-2, -1) for s in self.stacks)
        hidden = F.silu(torch._grouped_mm(x_sorted, gate, offs=offsets)) * torch._grouped_mm(x_sorted, up, offs=offsets)
        return torch._grouped_mm(hidden, down, offs=offsets)


class MoE:
    """Top-k routed SwiGLU experts; tokens are grouped so each expert runs one matmul (or all of
    them one grouped product: ``NEOPP_MOE_DISPATCH``)."""

    def __init__(self, router: Linear, experts: list[SwiGLU], top_k: int, norm_topk_prob: bool,
                 dispatch: str | None = None) -> None:
        self.router, self.experts, self.top_k, self.norm_topk_prob = router, experts, top_k, norm_topk_prob
        dispatch = check_moe_dispatch(dispatch or kernel_choices().moe_dispatch)
        cuda = experts[0].gate.weight.is_cuda
        wanted = dispatch == "grouped" or (dispatch == "auto" and cuda)
        self.grouped = GroupedExperts(experts) if wanted and GroupedExperts.fits(experts) else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] float32, expert ids [N, k])."""
        logits = self.router(x).float()
        if self.norm_topk_prob:
            top, ids = logits.topk(self.top_k, dim=-1)
            return top.softmax(dim=-1), ids
        return logits.softmax(dim=-1).topk(self.top_k, dim=-1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D]: each token routed on its own (the language tower's prefix holds a batch dim)."""
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).view(x.shape)
        weights, ids = self.route(x)
        flat_ids = ids.reshape(-1)
        order = flat_ids.argsort(stable=True)
        token_of = order // self.top_k
        slot_weight = weights.reshape(-1)[order]
        if self.grouped is not None:
            return self._grouped(x, flat_ids, order, token_of, slot_weight)
        out = torch.zeros_like(x)
        counts = torch.bincount(flat_ids, minlength=len(self.experts)).tolist()
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                tokens = token_of[start:start + count]
                y = expert(x[tokens]) * slot_weight[start:start + count, None].to(x.dtype)
                out.index_add_(0, tokens, y)
            start += count
        return out

    def _grouped(self, x: torch.Tensor, flat_ids: torch.Tensor, order: torch.Tensor, token_of: torch.Tensor,
                 slot_weight: torch.Tensor) -> torch.Tensor:
        """On the device throughout (no count reaches the host, so a CUDA graph can hold it) and
        deterministic: each group's end is a search in the sorted ids, and a token's top-k results
        are summed in a fixed order instead of by atomic adds."""
        experts = torch.arange(len(self.experts), device=x.device, dtype=flat_ids.dtype)
        ends = torch.searchsorted(flat_ids[order], experts, right=True).to(torch.int32)
        y = self.grouped(x[token_of], ends) * slot_weight[:, None].to(x.dtype)
        slots = torch.empty_like(y)
        slots[order] = y
        return slots.view(x.shape[0], self.top_k, -1).sum(dim=1)

    def linears(self) -> list[Linear]:
        return [self.router] + [lin for e in self.experts for lin in e.linears()]


@dataclass
class DecoderLayer:
    """Weights of one decoder layer (the generation tower's, or the demo language tower's)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    q_norm: torch.Tensor      # [2, HD/2]: temporal-half weight, spatial-half weight
    k_norm: torch.Tensor
    mlp: SwiGLU | MoE

    def linears(self) -> list[Linear]:
        return [self.q_proj, self.k_proj, self.v_proj, self.o_proj] + self.mlp.linears()


def split_head_norm(x: torch.Tensor, weights: torch.Tensor, eps: float = DEFAULT_RMS_NORM_EPS) -> torch.Tensor:
    """RMSNorm the temporal half and the spatial half of each head separately.

    `weights` is [2, HD/2] (temporal, spatial); one norm over a [..., 2, HD/2] view does both.
    """
    halves = x.view(*x.shape[:-1], 2, x.shape[-1] // 2)
    return rms_norm(halves, weights, eps).view_as(x)
