"""The understanding tower of the checkpoint, run over a prompt to produce its KV prefix.

Its weights carry the real key names without ``_mot_gen``; which ids a prompt becomes is the
checkpoint's own rule (:mod:`.prompt_ids`: U1's template, or the demo's words). Each layer's keys are stored after
the split q/k norm and the 3-D RoPE with text positions (temporal index = token position,
both spatial indices 0), and its values as projected: exactly what the generation tower
expects to find in a prefix, in the online layout ``[NL, 2, S, NKV, HD]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..json_file import read_json_object
from ..model.checkpoint import LM, layer_prefix, read_generation_tensors
from ..model.checkpoint_config import CheckpointConfig, checkpoint_folder
from ..model.embeddings import Grid, PatchEmbed
from ..model.gguf_checkpoint import GGUFLinear, GGUFWeight
from ..model.layer_offload import LayerOffload, layer_offload, streamed
from ..model.layers import DecoderLayer, Linear, rms_norm, split_head_norm
from ..model.rope import Rope3D
from .edit_images import Picture
from .prompt_ids import PromptIds, U1PromptIds, load_prompt_ids
from .understanding_mlp import UnderstandingMLP

EMBED = LM + "embed_tokens.weight"
FINAL_NORM = LM + "norm.weight"
LM_HEAD = "language_model.lm_head.weight"  # beside the model, under the same root
VISION_UND = "vision_model.embeddings."  # the understanding tower's own patch embedding (editing)
VISION_KEYS = tuple(VISION_UND + name for name in ("patch_embedding.weight", "patch_embedding.bias",
                                                    "dense_embedding.weight", "dense_embedding.bias"))
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
NORMS = ("q_norm", "k_norm", "q_norm_hw", "k_norm_hw")


def is_language_key(key: str) -> bool:
    return (key.startswith(LM) and "mot_gen" not in key) or key == LM_HEAD or key.startswith(VISION_UND)


def language_keys(config: CheckpointConfig, mlp: UnderstandingMLP) -> list[str]:
    """Every key the prefix needs (the last layer's MLP and the final norm do not shape a KV)."""
    keys = [EMBED]
    for i in range(config.num_layers):
        p = layer_prefix(i)
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        keys += [f"{p}self_attn.{name}.weight" for name in ATTN + NORMS]
        keys += mlp.keys(i)
    return keys


@dataclass
class PrefixCache:
    """One sequence's keys and values, room allocated once ([NL, 2, capacity, NKV, HD]), and how
    many tokens it holds: a token written one at a time copies nothing already there."""

    kv: torch.Tensor
    length: int = 0
    position: int = 0  # the temporal index the next token takes (a picture's tokens share one)

    def prefix(self) -> torch.Tensor:
        """What it holds: [NL, 2, length, NKV, HD]."""
        return self.kv[:, :, :self.length]


@dataclass(frozen=True)
class EmbeddedPictures:
    """An edit's pictures as the tower reads them: each one's token grid and its embedded tokens."""

    grids: list[tuple[int, int]]  # (rows, cols) of image tokens per picture
    tokens: tuple[torch.Tensor, ...]  # [rows * cols, D] per picture


class LanguageTower:
    """Token embedding and causal decoder layers; ``prefix_kv`` is batched so training and
    serving run the same code."""

    def __init__(self, config: CheckpointConfig, embed: torch.Tensor, layers: list[DecoderLayer],
                 prompt_ids: PromptIds, head: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.config, self.embed, self.layers, self.prompt_ids = config, embed, layers, prompt_ids
        self.head = head  # (final norm, lm_head): the tower can write text (think mode); None: prefixes only
        self.vision: PatchEmbed | None = None  # the pictures' embedding (editing); None: cannot edit
        self.vision_problem: str | None = "it has no vision embedding"  # why vision is None
        self._plain_unconditional: tuple[torch.Tensor, int] | None = None
        self.offload: LayerOffload | None = None  # None: every layer resident on the device

    @classmethod
    def from_pretrained(cls, ckpt_dir: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, offload: str | LayerOffload = "none") -> LanguageTower:
        """``offload``: a policy of :mod:`neopp.model.layer_offload` (or an offload, a test's
        stand-in on the CPU)."""
        device = torch.device(device)
        held = offload if isinstance(offload, LayerOffload) else layer_offload(offload, device)
        folder = checkpoint_folder(ckpt_dir)  # a GGUF file's tokenizer and config.json lie beside it
        try:
            prompt_ids = load_prompt_ids(folder)
        except ConfigError as exc:
            raise ConfigError(f"checkpoint {ckpt_dir}: {exc}") from exc
        config = CheckpointConfig.from_checkpoint(ckpt_dir)
        tensors = read_generation_tensors(ckpt_dir, is_language_key)  # GGUF layer linears stay in their blocks
        llm = read_json_object(folder / "config.json", "config.json").get("llm_config") or {}
        mlp = UnderstandingMLP.from_llm_config(llm)
        check_language_shapes(config, tensors, prompt_ids.vocabulary_size(), mlp)
        tied = llm.get("tie_word_embeddings") is True
        return cls.from_tensors(config, tensors, prompt_ids, device, dtype, tied, mlp, held)

    @classmethod
    def from_tensors(cls, config: CheckpointConfig, tensors: dict[str, torch.Tensor], prompt_ids: PromptIds,
                     device: torch.device, dtype: torch.dtype, tied: bool = False,
                     mlp: UnderstandingMLP | None = None, offload: LayerOffload | None = None) -> LanguageTower:
        """Tensors already on ``device`` in ``dtype`` (trainable parameters) are used as they are.
        ``tied``: the checkpoint's lm_head is its token embedding (``tie_word_embeddings``);
        ``mlp``: which layers route over experts (A3B; default: every MLP dense); ``offload``: takes
        each layer to host memory as soon as it is built."""
        mlp = mlp or UnderstandingMLP()

        def t(key: str) -> torch.Tensor:
            return tensors[key].to(device=device, dtype=dtype)

        def linear(key: str) -> Linear:  # a GGUF file's blocks stay blocks, dequantized per call
            weight = tensors[key]
            return GGUFLinear(weight, device) if isinstance(weight, GGUFWeight) else Linear(t(key))

        layers = []
        for i in range(config.num_layers):
            p, a = layer_prefix(i), layer_prefix(i) + "self_attn."
            lin = {name: linear(f"{a}{name}.weight") for name in ATTN}
            layers.append(DecoderLayer(
                input_norm=t(p + "input_layernorm.weight"), post_norm=t(p + "post_attention_layernorm.weight"),
                q_norm=torch.stack([t(a + "q_norm.weight"), t(a + "q_norm_hw.weight")]),
                k_norm=torch.stack([t(a + "k_norm.weight"), t(a + "k_norm_hw.weight")]),
                mlp=mlp.build(i, t, linear), **lin))
            if offload is not None:
                offload.adopt(layers[-1])
        head = None
        if FINAL_NORM in tensors and (LM_HEAD in tensors or tied):  # the output head, to write text with
            head = (t(FINAL_NORM), t(EMBED) if tied else t(LM_HEAD))
        tower = cls(config, t(EMBED), layers, prompt_ids, head)
        tower.offload = offload
        tower.vision_problem = vision_problem(config, tensors)
        if tower.vision_problem is None:
            tower.vision = PatchEmbed(*(t(key) for key in VISION_KEYS), config.patch_size)
        return tower

    def prefix_kv(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, S] -> [B, NL, 2, S, NKV, HD]. Causal, so a right-padded row's first tokens
        see only themselves and what precedes them; slice each row to its own length."""
        c = self.config
        b, s = ids.shape
        nh, nkv, hd, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        rope = Rope3D.text(s, hd, c.rope_theta, c.rope_theta_hw, ids.device)
        hid = F.embedding(ids, self.embed)
        kvs = []
        for _, layer in streamed(self.layers, self.offload):
            a = rms_norm(hid, layer.input_norm, eps)
            q = rope(split_head_norm(layer.q_proj(a).view(b, s, nh, hd), layer.q_norm, eps))
            k = rope(split_head_norm(layer.k_proj(a).view(b, s, nkv, hd), layer.k_norm, eps))
            v = layer.v_proj(a).view(b, s, nkv, hd)
            kvs.append(torch.stack([k, v], dim=1))                         # [B, 2, S, NKV, HD]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, scale=hd ** -0.5, enable_gqa=True)
            hid = hid + layer.o_proj(out.transpose(1, 2).reshape(b, s, nh * hd))
            hid = hid + layer.mlp(rms_norm(hid, layer.post_norm, eps))
        return torch.stack(kvs, dim=1)

    def cache(self, capacity: int) -> PrefixCache:
        """An empty prefix of room for ``capacity`` tokens, on the tower's device and dtype."""
        c = self.config
        kv = self.embed.new_empty(c.num_layers, 2, capacity, c.num_kv_heads, c.head_dim)
        return PrefixCache(kv)

    def extend(self, cache: PrefixCache, ids: list[int], positions: list[tuple[int, int, int]] | None = None,
               pictures: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        """Run ``ids`` after the tokens ``cache`` holds, their keys and values written in place.
        Each token sees what precedes it, and a picture's tokens (one temporal index) see each other.
        ``positions``: (t, h, w) per token, by default text positions continuing the cache's;
        ``pictures``: the embeddings that replace the ``<IMG_CONTEXT>`` tokens, in order. Returns the
        last token's hidden state after the final norm (the logits' input)."""
        c = self.config
        nh, nkv, hd, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        start, n, device = cache.length, len(ids), self.embed.device
        if start + n > cache.kv.shape[2]:
            raise RuntimeError(f"the prefix cache holds {cache.kv.shape[2]} tokens, not {start + n}")
        if positions is None:
            positions = [(cache.position + i, 0, 0) for i in range(n)]
        t, rows, cols = (list(v) for v in zip(*positions, strict=True))
        rope = Rope3D.at(t, rows, cols, hd, c.rope_theta, c.rope_theta_hw, device)
        seen, index = torch.arange(start + n, device=device), torch.tensor(t, device=device)
        mask = seen[None, :] <= seen[start:, None]  # [n, start + n]: causal over the whole sequence
        mask[:, start:] |= index[None, :] == index[:, None]
        token_ids = torch.tensor(ids, device=device)
        hid = F.embedding(token_ids, self.embed)
        if pictures:
            hid[token_ids == self.prompt_ids.picture_token()] = torch.cat(pictures).to(hid.dtype)
        for i, layer in streamed(self.layers, self.offload):
            a = rms_norm(hid, layer.input_norm, eps)
            q = rope(split_head_norm(layer.q_proj(a).view(n, nh, hd), layer.q_norm, eps))
            cache.kv[i, 0, start:start + n] = rope(split_head_norm(layer.k_proj(a).view(n, nkv, hd), layer.k_norm, eps))
            cache.kv[i, 1, start:start + n] = layer.v_proj(a).view(n, nkv, hd)
            keys, values = cache.kv[i, 0, :start + n], cache.kv[i, 1, :start + n]
            out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                                 attn_mask=mask, scale=hd ** -0.5, enable_gqa=True)
            hid = hid + layer.o_proj(out.transpose(0, 1).reshape(n, nh * hd))
            hid = hid + layer.mlp(rms_norm(hid, layer.post_norm, eps))
        cache.length, cache.position = start + n, max(t) + 1
        return rms_norm(hid[-1], self.head[0], eps) if self.head is not None else hid[-1]

    @torch.inference_mode()
    def embed_pictures(self, pictures: tuple[Picture, ...]) -> EmbeddedPictures:
        """Each picture's image tokens [rows * cols, D], row-major, through the vision embedding."""
        c, device = self.config, self.embed.device
        out = []
        for picture in pictures:
            _, _, height, width = picture.pixels.shape
            grid = Grid.build(height, width, c.patch_size, c.merge_size, c.vision_hidden_size, c.rope_theta_vision,
                              device)
            out.append(self.vision(picture.pixels.to(device=device, dtype=self.embed.dtype), grid))
        return EmbeddedPictures([(p.rows, p.cols) for p in pictures], tuple(out))

    @torch.inference_mode()
    def encode_with_pictures(self, ids: list[int], pictures: EmbeddedPictures) -> tuple[torch.Tensor, int]:
        """One prefix holding pictures among its words, and its index offset (the temporal index
        after its last token, not its length: a picture takes one)."""
        cache = self.cache(len(ids))
        self.extend(cache, ids, self.prompt_ids.positions(ids, pictures.grids), pictures.tokens)
        return cache.prefix(), cache.position

    def edit_prefixes(self, prompt: str, pictures: EmbeddedPictures,
                      with_cond: bool = True) -> tuple[tuple[torch.Tensor, int] | None, tuple[torch.Tensor, int]]:
        """An edit's conditional prefix (pictures and ``PROMPT``; None unless ``with_cond``: think
        mode writes its own) and its image-only one."""
        ids = self.prompt_ids
        cond = self.encode_with_pictures(ids.edit_conditional(prompt, pictures.grids), pictures) if with_cond else None
        return cond, self.encode_with_pictures(ids.image_only(pictures.grids), pictures)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The next token's scores over the vocabulary (needs the output head)."""
        return F.linear(hidden, self.head[1])

    @torch.inference_mode()
    def encode_ids(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        """One prefix [NL, 2, S, NKV, HD] and its index offset (the position after it)."""
        batch = torch.tensor([ids], device=self.embed.device)
        return self.prefix_kv(batch)[0], len(ids)

    @torch.inference_mode()
    def encode_many(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, int]]:
        """Several prompts' prefixes in one forward, each as ``encode_ids`` gives it (within float
        rounding: a matrix product over more rows may sum in another order). The tokens of all of
        them go side by side through every projection and MLP, one matrix product per weight for
        the lot; each sequence attends only to its own tokens, at its own positions: nothing is
        padded, nothing leaks between prompts. One sequence takes ``encode_ids`` itself."""
        if len(sequences) == 1:
            return [self.encode_ids(sequences[0])]
        c, device = self.config, self.embed.device
        nh, nkv, hd, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        lengths = [len(ids) for ids in sequences]
        total = sum(lengths)
        rope = Rope3D.concat([Rope3D.text(n, hd, c.rope_theta, c.rope_theta_hw, device) for n in lengths])
        hid = F.embedding(torch.tensor([i for ids in sequences for i in ids], device=device), self.embed)
        kv = self.embed.new_empty(c.num_layers, 2, total, nkv, hd)
        for i, layer in streamed(self.layers, self.offload):
            a = rms_norm(hid, layer.input_norm, eps)
            q = rope(split_head_norm(layer.q_proj(a).view(total, nh, hd), layer.q_norm, eps))
            kv[i, 0] = rope(split_head_norm(layer.k_proj(a).view(total, nkv, hd), layer.k_norm, eps))
            kv[i, 1] = layer.v_proj(a).view(total, nkv, hd)
            out = torch.cat([F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                                            is_causal=True, scale=hd ** -0.5, enable_gqa=True)
                             for qs, ks, vs in zip(q.split(lengths), kv[i, 0].split(lengths), kv[i, 1].split(lengths),
                                                   strict=True)], dim=1)
            hid = hid + layer.o_proj(out.transpose(0, 1).reshape(total, nh * hd))
            hid = hid + layer.mlp(rms_norm(hid, layer.post_norm, eps))
        return [(prefix, n) for prefix, n in zip(kv.split(lengths, dim=2), lengths, strict=True)]

    def conditional(self, prompt: str) -> tuple[torch.Tensor, int]:
        """``PROMPT``'s prefix and index offset."""
        return self.encode_ids(self.prompt_ids.conditional(prompt))

    def unconditional(self, negative_prompt: str = "") -> tuple[torch.Tensor, int]:
        """The unconditional prefix (``NEGATIVE_PROMPT`` in its text's place) and its index offset.
        Without a negative prompt it is the same for every request: computed once, then reused
        (the tensor is shared: callers copy it, never write to it)."""
        if negative_prompt:
            return self.encode_ids(self.prompt_ids.unconditional(negative_prompt))
        if self._plain_unconditional is None:
            self._plain_unconditional = self.encode_ids(self.prompt_ids.unconditional(""))
        return self._plain_unconditional


def cannot_edit(tower: LanguageTower) -> str | None:
    """Why this checkpoint's encoder refuses input pictures, or None."""
    if not isinstance(tower.prompt_ids, U1PromptIds):
        return ("this checkpoint cannot edit pictures: the demo model has no image understanding "
                "(a SenseNova-U1 checkpoint edits)")
    if tower.vision is None:
        return f"this checkpoint cannot edit pictures: {tower.vision_problem}"
    return None


def vision_problem(config: CheckpointConfig, tensors: dict[str, torch.Tensor]) -> str | None:
    """What keeps the picture embedding from loading (every key, each of its shape), or None.
    Prompts are served without it; only editing is refused, with this reason."""
    d, dv, ps, m = config.hidden_size, config.vision_hidden_size, config.patch_size, config.merge_size
    want = dict(zip(VISION_KEYS, ((dv, 3, ps, ps), (dv,), (d, dv, m, m), (d,)), strict=True))
    for key, shape in want.items():
        if key not in tensors:
            return f"its vision embedding tensor '{key}' is missing"
        if tuple(tensors[key].shape) != shape:
            return f"its vision embedding tensor '{key}' has shape {tuple(tensors[key].shape)}, expected {shape}"
    return None


def check_language_shapes(config: CheckpointConfig, tensors: dict[str, torch.Tensor], vocab: int,
                          mlp: UnderstandingMLP) -> None:
    """Every key present, with the geometry of the generation tower it feeds; an embedding row for
    every id the tokenizer makes (a real checkpoint pads its table past the tokenizer's ids)."""
    d, hd = config.hidden_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    rows = tensors[EMBED].shape[0] if EMBED in tensors and tensors[EMBED].dim() == 2 else 0
    want = {EMBED: (max(vocab, rows), d)}
    for i in range(config.num_layers):
        p, a = layer_prefix(i), layer_prefix(i) + "self_attn."
        want.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                     a + "q_proj.weight": (q, d), a + "k_proj.weight": (kv, d), a + "v_proj.weight": (kv, d),
                     a + "o_proj.weight": (d, q)})
        want.update({f"{a}{n}.weight": (hd // 2,) for n in NORMS})
        want.update(mlp.shapes(i, d, tensors))
    want.update({FINAL_NORM: (d,), LM_HEAD: (want[EMBED][0], d)})  # the output head, where present
    for key in (FINAL_NORM, LM_HEAD):
        if key in tensors and tuple(tensors[key].shape) != want[key]:
            raise ConfigError(f"checkpoint: '{key}' has shape {tuple(tensors[key].shape)}, expected {want[key]}")
    for key in language_keys(config, mlp):
        if key not in tensors:
            raise ConfigError(f"checkpoint: language-tower tensor '{key}' is missing{_dense_or_routed(mlp, key)}")
        if key in want and tuple(tensors[key].shape) != want[key]:
            raise ConfigError(f"checkpoint: '{key}' has shape {tuple(tensors[key].shape)}, expected {want[key]}")


def _dense_or_routed(mlp: UnderstandingMLP, key: str) -> str:
    """What config.json said that makes ``key`` expected: an MLP it routes, or one it does not."""
    if ".mlp." not in key:
        return ""
    if mlp.num_experts:
        return (f" (config.json routes this layer over {mlp.num_experts} experts: 'num_experts', "
                "'mlp_only_layers', 'decoder_sparse_step')")
    return " (config.json names no understanding experts: 'llm_config.num_experts' is unset)"
