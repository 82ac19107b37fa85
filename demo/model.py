"""The demo model: a small SenseNova-U1-shaped checkpoint with both towers, and its batched
training forward.

The weights live in a dict keyed by the real checkpoint names; serving builds its towers from
that dict with the runtime code (`NeoPPTransformer.from_tensors`, `LanguageTower.from_tensors`).
Training reuses the runtime's language tower as it is (it is batched) and runs the generation
tower through `GenerationBatch`, a batched restatement of the runtime's per-request forward
over the same runtime building blocks; a test checks the two agree.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from neopp.model.checkpoint import FM, LM, VISION, layer_prefix
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.model.embeddings import PixelHead, patchify, sinusoid
from neopp.model.layers import rms_norm, split_head_norm
from neopp.model.rope import Rope3D, apply_vision_rope, vision_rope_tables
from neopp.model.transformer import NeoPPTransformer
from neopp.text.language_tower import LanguageTower
from neopp.text.prompt_ids import DemoPromptIds
from neopp.text.tokenizer import BOS, PAD, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, UNK, WordTokenizer

LLM = {"num_hidden_layers": 3, "hidden_size": 192, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 48, "rope_theta": 10_000.0, "rope_theta_hw": 10_000.0, "rms_norm_eps": 1e-6}
VISION_CFG = {"hidden_size": 64, "rope_theta_vision": 10_000.0, "max_position_embeddings_vision": 1024}
MLP_WIDTH, HEAD_WIDTH, TOKEN = 512, 384, 32
PIXEL_CONV1 = 256  # the pixel head's first conv: 16-px cells, then 64 channels per 8-px cell
# The demo's images are small: noise grows from a 4x4-token (128 px) image, not from an 8x8 one.
NOISE = {"noise_scale": 1.0, "noise_scale_mode": "resolution", "noise_scale_base_image_seq_len": 16,
         "noise_scale_max_value": 8.0}
DRAWN_SIZE = [256, 256]  # what the demo is trained to draw: its models' default size
TRAINED_SIDES = [128, 320]  # every side the training draws (shapes.SIZES): the server refuses others


def demo_config(moe: dict | None = None, pixel_head: bool = True) -> dict:
    llm = dict(LLM, **(moe or {}))
    return {"model_type": "neo_chat", "llm_config": llm, "vision_config": dict(VISION_CFG), "patch_size": 16,
            "use_pixel_head": pixel_head, "add_noise_scale_embedding": True, **NOISE,
            "default_image_size": list(DRAWN_SIZE), "image_size_range": list(TRAINED_SIDES)}


def demo_tokenizer(words: list[str], max_tokens: int = 32) -> WordTokenizer:
    return WordTokenizer((PAD, BOS, UNK, *sorted(set(words))), max_tokens)


def init_weights(cfg: dict, vocab: int, seed: int, pixel_conv1: int = PIXEL_CONV1) -> dict[str, torch.Tensor]:
    """Both towers, seeded: linears ~ N(0, 1/fan_in), norms at 1, biases at 0; the residual
    outputs start small so the untrained tower is close to its embeddings."""
    g = torch.Generator().manual_seed(seed)
    llm, dv = cfg["llm_config"], cfg["vision_config"]["hidden_size"]
    d, hd, nh, nkv, layers = llm["hidden_size"], llm["head_dim"], llm["num_attention_heads"], \
        llm["num_key_value_heads"], llm["num_hidden_layers"]

    def lin(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) * (gain / math.sqrt(in_f))

    def conv(out_c: int, in_c: int, k: int) -> torch.Tensor:
        return torch.randn(out_c, in_c, k, k, generator=g) / math.sqrt(in_c * k * k)

    w = {VISION + "patch_embedding.weight": conv(dv, 3, 16), VISION + "patch_embedding.bias": torch.zeros(dv),
         VISION + "dense_embedding.weight": conv(d, dv, 2), VISION + "dense_embedding.bias": torch.zeros(d),
         LM + "norm_mot_gen.weight": torch.ones(d), LM + "norm.weight": torch.ones(d),
         LM + "embed_tokens.weight": torch.randn(vocab, d, generator=g)}
    h = FM + "fm_head."
    if cfg["use_pixel_head"]:
        w.update({h + "conv1.weight": conv(pixel_conv1, d // 4, 3), h + "conv1.bias": torch.zeros(pixel_conv1),
                  h + "conv2.weight": conv(3 * 64, pixel_conv1 // 4, 3) * 0.1, h + "conv2.bias": torch.zeros(3 * 64)})
    else:
        out = TOKEN * TOKEN * 3
        w.update({h + "0.weight": lin(HEAD_WIDTH, d), h + "0.bias": torch.zeros(HEAD_WIDTH),
                  h + "2.weight": lin(out, HEAD_WIDTH, 0.1), h + "2.bias": torch.zeros(out)})
    for emb in ("timestep_embedder", "noise_scale_embedder"):
        p = f"{FM}{emb}.mlp."
        w.update({p + "0.weight": lin(d, 256), p + "0.bias": torch.zeros(d),
                  p + "2.weight": lin(d, d), p + "2.bias": torch.zeros(d)})
    for i in range(layers):
        p, a = layer_prefix(i), layer_prefix(i) + "self_attn."
        for sfx in ("_mot_gen", ""):
            w.update({f"{p}input_layernorm{sfx}.weight": torch.ones(d),
                      f"{p}post_attention_layernorm{sfx}.weight": torch.ones(d),
                      f"{a}q_proj{sfx}.weight": lin(nh * hd, d), f"{a}k_proj{sfx}.weight": lin(nkv * hd, d),
                      f"{a}v_proj{sfx}.weight": lin(nkv * hd, d), f"{a}o_proj{sfx}.weight": lin(d, nh * hd, 0.3)})
            for norm in ("q_norm", "k_norm", "q_norm_hw", "k_norm_hw"):
                w[f"{a}{norm}{sfx}.weight"] = torch.ones(hd // 2)
            m = f"{p}mlp{sfx}."
            w.update({m + "gate_proj.weight": lin(MLP_WIDTH, d), m + "up_proj.weight": lin(MLP_WIDTH, d),
                      m + "down_proj.weight": lin(d, MLP_WIDTH, 0.3)})
    return w


def save_checkpoint(out_dir: Path, cfg: dict, tokenizer: WordTokenizer, weights: dict[str, torch.Tensor],
                    dtype: torch.dtype = torch.bfloat16) -> Path:
    """config.json, the tokenizer's two files and one safetensors file in ``dtype`` (bf16 halves the size)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out_dir / TOKENIZER_FILE).write_text(json.dumps(tokenizer.to_json(), indent=1) + "\n")
    (out_dir / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer.config_json(), indent=1) + "\n")
    save_file({k: v.detach().to("cpu", dtype).contiguous() for k, v in sorted(weights.items())},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def load_demo(ckpt_dir: Path) -> tuple[CheckpointConfig, WordTokenizer, dict[str, torch.Tensor]]:
    """A saved demo checkpoint in float32: its config, tokenizer and tensors, where runs and probes
    that start from a trained model begin."""
    config = CheckpointConfig.from_dict(json.loads((ckpt_dir / "config.json").read_text()))
    tensors = {k: v.float() for k, v in load_file(str(ckpt_dir / "model.safetensors")).items()}
    return config, WordTokenizer.from_file(ckpt_dir / TOKENIZER_FILE), tensors


class GenerationBatch:
    """The generation tower over a batch of same-size images, each with its own prefix.

    Prefixes are right-padded to one length; ``lengths`` masks the padding out of attention
    and each image's temporal RoPE index is its prefix's index offset (= its length).
    """

    def __init__(self, config: CheckpointConfig, tower: NeoPPTransformer) -> None:
        self.config, self.tower = config, tower
        self._ropes: dict[tuple, Rope3D] = {}

    def embed(self, x: torch.Tensor, t: torch.Tensor, noise_scale: float) -> torch.Tensor:
        """x [B, 3, H, W], t [B] -> tokens [B, L, D]."""
        c, pe = self.config, self.tower.patch
        feats = F.conv2d(x, pe.patch_w, pe.patch_b, stride=pe.patch_size)
        b, dv, rows, cols = feats.shape
        seq = F.gelu(feats.flatten(2).transpose(1, 2)).reshape(b * rows * cols, dv)
        cos, sin = (v.to(x.device) for v in vision_rope_tables(rows, cols, dv, c.rope_theta_vision))
        seq = apply_vision_rope(seq, cos.repeat(b, 1, 1), sin.repeat(b, 1, 1))
        feats = seq.view(b, rows * cols, dv).transpose(1, 2).reshape(b, dv, rows, cols)
        tokens = F.conv2d(feats, pe.dense_w, pe.dense_b, stride=pe.dense_w.shape[-1]).flatten(2).transpose(1, 2)
        cond = self._embedder(self.tower.t_embed, t)
        if self.tower.ns_embed is not None:
            scale = torch.full_like(t, noise_scale / c.noise_scale_max_value)
            cond = cond + self._embedder(self.tower.ns_embed, scale)
        return tokens + cond[:, None, :]

    def _rope(self, offset: int, rows: int, cols: int, device: torch.device) -> Rope3D:
        """One image's tables, kept: a batch holds few distinct prompt lengths and grids."""
        key = (offset, rows, cols, str(device))
        if key not in self._ropes:
            c = self.config
            self._ropes[key] = Rope3D(offset, rows, cols, c.head_dim, c.rope_theta, c.rope_theta_hw, device)
        return self._ropes[key]

    @staticmethod
    def _embedder(emb, values: torch.Tensor) -> torch.Tensor:
        return emb.fc2(F.silu(emb.fc1(sinusoid(values.detach(), values.device))))

    def predict(self, x: torch.Tensor, t: torch.Tensor, noise_scale: float, prefix: torch.Tensor,
                lengths: torch.Tensor) -> torch.Tensor:
        """Clean-image prediction [B, L, T*T*3]; prefix [B, NL, 2, S, NKV, HD] (online, padded)."""
        c = self.config
        b, _, height, width = x.shape
        rows, cols = height // TOKEN, width // TOKEN
        nh, nkv, hd, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        hid = self.embed(x, t, noise_scale)
        n, s = hid.shape[1], prefix.shape[3]
        tables = [self._rope(int(o), rows, cols, x.device) for o in lengths.tolist()]
        rope = Rope3D._from_tables(torch.stack([r.cos for r in tables]), torch.stack([r.sin for r in tables]),
                                   tables[0].perm)
        keep = torch.arange(s + n, device=x.device)[None, :] < lengths[:, None]
        keep = keep | (torch.arange(s + n, device=x.device)[None, :] >= s)
        mask = keep[:, None, None, :]                                         # [B, 1, 1, S+L]
        for i, layer in enumerate(self.tower.layers):
            a = rms_norm(hid, layer.input_norm, eps)
            q = rope(split_head_norm(layer.q_proj(a).view(b, n, nh, hd), layer.q_norm, eps))
            k = rope(split_head_norm(layer.k_proj(a).view(b, n, nkv, hd), layer.k_norm, eps))
            v = layer.v_proj(a).view(b, n, nkv, hd)
            keys = torch.cat([prefix[:, i, 0], k], dim=1).transpose(1, 2)
            values = torch.cat([prefix[:, i, 1], v], dim=1).transpose(1, 2)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                                 scale=hd ** -0.5, enable_gqa=True)
            hid = hid + layer.o_proj(out.transpose(1, 2).reshape(b, n, nh * hd))
            hid = hid + layer.mlp(rms_norm(hid, layer.post_norm, eps).view(b * n, -1)).view(b, n, -1)
        return self.head(rms_norm(hid, self.tower.final_norm, eps), rows, cols)

    def head(self, hid: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """[B, L, D] -> [B, L, T*T*3], the runtime's head over a batch."""
        head = self.tower.head
        if isinstance(head, PixelHead):
            return target_tokens(head.image(hid.transpose(1, 2).reshape(hid.shape[0], hid.shape[2], rows, cols)))
        return head.fc2(F.gelu(head.fc1(hid)))


def towers(config: CheckpointConfig, params: dict[str, torch.Tensor], tokenizer: WordTokenizer
           ) -> tuple[LanguageTower, GenerationBatch]:
    """The runtime's towers over ``params`` (trainable tensors stay the same objects, on their device)."""
    dev, dtype = next(iter(params.values())).device, torch.float32
    language = LanguageTower.from_tensors(config, params, DemoPromptIds(tokenizer), dev, dtype)
    gen = {k: v for k, v in params.items() if k.startswith(FM) or "mot_gen" in k}
    return language, GenerationBatch(config, NeoPPTransformer.from_tensors(config, gen, dev, dtype))


def target_tokens(images: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] -> [B, L, T*T*3] in the layout of z."""
    return torch.stack([patchify(img[None], TOKEN) for img in images])
