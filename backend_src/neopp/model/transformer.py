"""The generation tower: weights assembled from a checkpoint, and one forward per KV branch."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .attention import Attention, grouped_attention
from .checkpoint import FM, LM, VISION, layer_prefix
from .checkpoint_config import CheckpointConfig
from .embeddings import Grid, MLPEmbedder, MLPHead, PatchEmbed, PixelHead
from .gguf_checkpoint import GGUFLinear, GGUFWeight
from .layer_offload import LayerOffload, streamed
from .layers import DecoderLayer, Linear, MoE, SwiGLU, rms_norm, split_head_norm
from .rope import Rope3D

# (checkpoint key of the weight, weight, bias or None, all tensors) -> callable linear
LinearFactory = Callable[[str, torch.Tensor, "torch.Tensor | None", dict], Linear]


class BranchContext:
    """One KV branch of one request: its prefix laid out for attention once, and its RoPE.

    The buffers hold `S + L` positions per layer; the prefix is copied in once per request
    and each step only overwrites the image tokens' slots, so the prefix is never re-copied.
    """

    def __init__(self, kv_online: torch.Tensor, offset: int, grid: Grid, config: CheckpointConfig,
                 device: torch.device, dtype: torch.dtype, attention: Attention = grouped_attention) -> None:
        layers, _, seq, kv_heads, head_dim = kv_online.shape
        self.attention = attention
        total = seq + grid.num_tokens
        self.prefix_len = seq
        self.k = torch.empty(layers, kv_heads, total, head_dim, device=device, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.k[:, :, :seq].copy_(kv_online[:, 0].transpose(1, 2))
        self.v[:, :, :seq].copy_(kv_online[:, 1].transpose(1, 2))
        self.rope = Rope3D(offset, grid.rows, grid.cols, head_dim, config.rope_theta, config.rope_theta_hw, device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [L, NH, HD], k/v [L, NKV, HD] of the image tokens -> [L, NH*HD]."""
        s = self.prefix_len
        self.k[layer, :, s:].copy_(k.transpose(0, 1))
        self.v[layer, :, s:].copy_(v.transpose(0, 1))
        return self.attention(q, self.k[layer], self.v[layer])


class BatchedBranches:
    """Several branches' tokens in one batch: projections and MLPs run once over all of them,
    attention runs per branch over its own prefix (batched CFG on one device)."""

    def __init__(self, branches: list[BranchContext]) -> None:
        self.branches = branches
        self.sizes = [b.rope.cos.shape[0] for b in branches]
        self.rope = Rope3D.concat([b.rope for b in branches])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        parts = zip(self.branches, q.split(self.sizes), k.split(self.sizes), v.split(self.sizes))
        return torch.cat([b.attend(layer, qi, ki, vi) for b, qi, ki, vi in parts])


class NeoPPTransformer:
    """Pre-infer (embed), the decoder layers (per branch), post-infer (head)."""

    def __init__(self, config: CheckpointConfig, patch: PatchEmbed, t_embed: MLPEmbedder, ns_embed: MLPEmbedder | None,
                 layers: list[DecoderLayer], final_norm: torch.Tensor, head: MLPHead | PixelHead,
                 offload: LayerOffload | None = None) -> None:
        self.config, self.patch, self.t_embed, self.ns_embed = config, patch, t_embed, ns_embed
        self.layers, self.final_norm, self.head = layers, final_norm, head
        self.offload = offload  # None: every layer resident on the device
        self._compiled: tuple[Callable, Callable] | None = None

    def embed(self, x: torch.Tensor, t: float, noise_scale: float, grid: Grid) -> torch.Tensor:
        """Image tokens [L, D] of the current estimate at time t (shared by both branches)."""
        tokens = self.patch(x, grid)
        cond = self.t_embed(t, tokens.dtype)
        if self.ns_embed is not None:
            cond = cond + self.ns_embed(noise_scale / self.config.noise_scale_max_value, tokens.dtype)
        return tokens + cond

    def run_layers(self, hid: torch.Tensor, branch: BranchContext | BatchedBranches, layers: range | None = None,
                   eager: bool = False) -> torch.Tensor:
        """The decoder layers (``layers``: a contiguous part of them, as a step cache runs; ``eager``:
        the plain layer functions, never compiled ones, as a step carrying adapters runs)."""
        heads = (self.config.num_heads, self.config.num_kv_heads, self.config.head_dim)
        eps = self.config.rms_norm_eps  # upstream ties every norm of the tower (q/k ones too) to it
        # Row-major like a batch's concatenation: a transposed view (the patch embedding's) would
        # reduce and multiply in another order than the same rows inside a batch.
        hid = hid.contiguous()
        before, after = (attention_inputs, layer_output) if eager else self.layer_parts
        for i, layer in streamed(self.layers, self.offload, layers):
            q, k, v = before(layer, hid, branch.rope, heads, eps)
            hid = after(layer, hid, branch.attend(i, q, k, v), eps)
        return hid

    @property
    def layer_parts(self) -> tuple[Callable, Callable]:
        """A layer's work before and after attention: as written, or compiled (`compile_layers`)."""
        return self._compiled or (attention_inputs, layer_output)

    @property
    def reads_host_values(self) -> bool:
        """Does a step copy values to the host mid-layer (MoE experts run as a loop, or grouped where
        the fused kernel does not run)? A CUDA graph cannot hold such a step."""
        return any(isinstance(layer.mlp, MoE) and (layer.mlp.grouped is None or layer.mlp.grouped.reads_host_values)
                   for layer in self.layers)

    def compile_layers(self, on: bool = True) -> None:
        """Run every layer's elementwise work fused by `torch.compile` (one compilation serves all
        layers: the weights are arguments; a second token count makes it shape-generic)."""
        self._compiled = (torch.compile(attention_inputs), torch.compile(layer_output)) if on else None

    def predict(self, hid: torch.Tensor, grid: Grid) -> torch.Tensor:
        """Final norm and head: the clean-image prediction [L, T*T*3] in the layout of z."""
        return self.head(rms_norm(hid, self.final_norm, self.config.rms_norm_eps), grid)

    def linears(self) -> list[Linear]:
        return [lin for layer in self.layers for lin in layer.linears()]

    @staticmethod
    def from_tensors(config: CheckpointConfig, tensors: dict[str, torch.Tensor], device: torch.device,
                     dtype: torch.dtype, layer_linear: LinearFactory | None = None,
                     offload: LayerOffload | None = None) -> NeoPPTransformer:
        """Assemble from checked checkpoint tensors; `layer_linear` builds decoder-layer linears
        (the FP8 mode passes its own), every other weight is cast to `dtype`; `offload` takes each
        layer to host memory as soon as it is built, so the device never holds more than one."""

        def t(key: str) -> torch.Tensor:
            return tensors[key].to(device=device, dtype=dtype)

        def lin(key: str, bias: bool = False) -> Linear:
            return Linear(dequantised(key, tensors, device, dtype), t(key[: -len("weight")] + "bias") if bias else None)

        def plain(key: str, weight: torch.Tensor, bias: torch.Tensor | None, all_t: dict) -> Linear:
            if isinstance(weight, GGUFWeight):  # stays in its blocks, dequantized per call
                return GGUFLinear(weight, device)
            return Linear(dequantised(key, all_t, device, dtype))

        make = layer_linear or plain

        def layer_lin(key: str) -> Linear:
            return make(key, tensors[key], None, tensors)

        def swiglu(prefix: str) -> SwiGLU:
            return SwiGLU(*(layer_lin(f"{prefix}{name}.weight") for name in ("gate_proj", "up_proj", "down_proj")))

        layers = []
        for i in range(config.num_layers):
            p, a, m = layer_prefix(i), layer_prefix(i) + "self_attn.", layer_prefix(i) + "mlp_mot_gen."
            if config.is_moe:
                experts = [swiglu(f"{m}experts.{j}.") for j in range(config.num_experts)]
                mlp = MoE(lin(m + "gate.weight"), experts, config.num_experts_per_tok, config.norm_topk_prob)
            else:
                mlp = swiglu(m)
            layers.append(DecoderLayer(
                input_norm=t(p + "input_layernorm_mot_gen.weight"),
                post_norm=t(p + "post_attention_layernorm_mot_gen.weight"),
                q_proj=layer_lin(a + "q_proj_mot_gen.weight"), k_proj=layer_lin(a + "k_proj_mot_gen.weight"),
                v_proj=layer_lin(a + "v_proj_mot_gen.weight"), o_proj=layer_lin(a + "o_proj_mot_gen.weight"),
                q_norm=torch.stack([t(a + "q_norm_mot_gen.weight"), t(a + "q_norm_hw_mot_gen.weight")]),
                k_norm=torch.stack([t(a + "k_norm_mot_gen.weight"), t(a + "k_norm_hw_mot_gen.weight")]),
                mlp=mlp))
            if offload is not None:
                offload.adopt(layers[-1])
        patch = PatchEmbed(t(VISION + "patch_embedding.weight"), t(VISION + "patch_embedding.bias"),
                           t(VISION + "dense_embedding.weight"), t(VISION + "dense_embedding.bias"), config.patch_size)

        def embedder(name: str) -> MLPEmbedder:
            return MLPEmbedder(lin(f"{FM}{name}.mlp.0.weight", True), lin(f"{FM}{name}.mlp.2.weight", True))

        if config.use_pixel_head:
            h = FM + "fm_head."
            head = PixelHead(t(h + "conv1.weight"), t(h + "conv1.bias"), t(h + "conv2.weight"), t(h + "conv2.bias"))
        else:
            head = MLPHead(lin(FM + "fm_head.0.weight", True), lin(FM + "fm_head.2.weight", True))
        ns = embedder("noise_scale_embedder") if config.add_noise_scale_embedding else None
        return NeoPPTransformer(config, patch, embedder("timestep_embedder"), ns, layers,
                                t(LM + "norm_mot_gen.weight"), head, offload)


def attention_inputs(layer: DecoderLayer, hid: torch.Tensor, rope: Rope3D, heads: tuple[int, int, int],
                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's queries and keys (normed per half-head, rotated) and values, for attention."""
    nh, nkv, hd = heads
    a = rms_norm(hid, layer.input_norm, eps)
    n = a.shape[0]
    q = rope(split_head_norm(layer.q_proj(a).view(n, nh, hd), layer.q_norm, eps))
    k = rope(split_head_norm(layer.k_proj(a).view(n, nkv, hd), layer.k_norm, eps))
    return q, k, layer.v_proj(a).view(n, nkv, hd)


def layer_output(layer: DecoderLayer, hid: torch.Tensor, attended: torch.Tensor, eps: float) -> torch.Tensor:
    """The residual stream after the layer: attention's projection, then the MLP."""
    hid = hid + layer.o_proj(attended)
    return hid + layer.mlp(rms_norm(hid, layer.post_norm, eps))


def dequantised(key: str, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A weight in full precision; an FP8 weight with its per-channel scale is expanded."""
    weight = tensors[key]
    scale = tensors.get(key + "_scale")
    if scale is None:
        return weight.to(device=device, dtype=dtype)
    full = weight.to(device=device, dtype=torch.float32) * scale.to(device=device, dtype=torch.float32).view(-1, 1)
    return full.to(dtype)
