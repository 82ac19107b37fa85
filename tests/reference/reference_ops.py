"""The float64 reference's building blocks: the checkpoint as float64 tensors, small ops written
as plain loops or formulas, the shifted schedule and the noise draw (see neopp_reference)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

F64 = torch.float64
P = 16  # patch size
M = 2  # merge size
T = P * M  # pixels per side of one image token


# --------------------------------------------------------------------------- checkpoint

class RefModel:
    """config.json + the generation tower's weights, as float64 tensors."""

    def __init__(self, ckpt_dir):
        ckpt_dir = Path(ckpt_dir)
        raw = json.loads((ckpt_dir / "config.json").read_text())
        llm, vis = raw["llm_config"], raw["vision_config"]
        self.NL = int(llm["num_hidden_layers"])
        self.D = int(llm["hidden_size"])
        self.NH = int(llm["num_attention_heads"])
        self.NKV = int(llm["num_key_value_heads"])
        self.HD = int(llm["head_dim"])
        self.rope_theta = float(llm["rope_theta"])
        self.rope_theta_hw = float(llm["rope_theta_hw"])
        self.num_experts = int(llm.get("gen_num_experts") or llm.get("num_experts") or 0)
        self.top_k = int(llm.get("gen_num_experts_per_tok") or llm.get("num_experts_per_tok") or 0)
        self.eps = float(llm.get("rms_norm_eps", 1e-6))
        self.norm_topk_prob = bool(llm.get("norm_topk_prob", True))
        self.DV = int(vis["hidden_size"])
        self.rope_theta_vision = float(vis["rope_theta_vision"])
        self.noise_scale_init = float(raw.get("noise_scale", 1.0))
        self.noise_scale_mode = raw.get("noise_scale_mode", "resolution")
        self.noise_base = int(raw.get("noise_scale_base_image_seq_len", 64))
        self.noise_max = float(raw.get("noise_scale_max_value", 8.0))
        self.add_noise_embedding = bool(raw.get("add_noise_scale_embedding", True))
        self.use_pixel_head = bool(raw.get("use_pixel_head", False))
        assert int(raw.get("patch_size", 16)) == P

        index = ckpt_dir / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in ckpt_dir.glob("*.safetensors"))
        raw_w = {}
        for name in files:
            with safe_open(str(ckpt_dir / name), framework="pt") as fh:
                for key in fh.keys():
                    used = key.startswith(("fm_modules.", "vision_model.")) or (
                        key.startswith("language_model.model.") and "mot_gen" in key)
                    if used:
                        raw_w[key] = fh.get_tensor(key)
        self.w = {}
        for key, t in raw_w.items():
            if key.endswith(".weight_scale"):
                continue
            t = t.to(F64)
            scale = raw_w.get(key + "_scale")  # FP8: "<name>.weight" + "_scale"
            if scale is not None:
                t = t * scale.to(F64).reshape(-1, *([1] * (t.dim() - 1)))
            self.w[key] = t

    def __getitem__(self, key):
        return self.w[key]

    def layer(self, i, rest):
        return self.w[f"language_model.model.layers.{i}.{rest}"]


def as_model(ckpt) -> RefModel:
    return ckpt if isinstance(ckpt, RefModel) else RefModel(ckpt)


# --------------------------------------------------------------------------- small pieces

def rmsnorm(x, weight, eps):
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def silu(x):
    return x / (1.0 + torch.exp(-x))


def linear(x, weight, bias=None):
    y = x @ weight.T
    return y if bias is None else y + bias


def softmax(x):
    e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


def cut(img, p, channel_last):
    """img [3, H, W] -> [(H/p)*(W/p), 3*p*p], patches row-major; (c,p,q) or (p,q,c)."""
    _, H, W = img.shape
    rows = []
    for R in range(H // p):
        for C in range(W // p):
            blk = img[:, R * p:(R + 1) * p, C * p:(C + 1) * p]
            rows.append((blk.permute(1, 2, 0) if channel_last else blk).reshape(-1))
    return torch.stack(rows)


def uncut_channel_last(z, H, W, p):
    """Inverse of cut(img, p, channel_last=True)."""
    img = torch.zeros(3, H, W, dtype=F64)
    n = 0
    for R in range(H // p):
        for C in range(W // p):
            img[:, R * p:(R + 1) * p, C * p:(C + 1) * p] = z[n].reshape(p, p, 3).permute(2, 0, 1)
            n += 1
    return img


def pixel_shuffle(x, r):
    """[C*r*r, h, w] -> [C, h*r, w*r]: out[c, y*r+i, x*r+j] = in[c*r*r + i*r + j, y, x]."""
    Crr, h, w = x.shape
    C = Crr // (r * r)
    out = torch.zeros(C, h * r, w * r, dtype=F64)
    for i in range(r):
        for j in range(r):
            out[:, i::r, j::r] = x[torch.arange(C) * r * r + i * r + j]
    return out


def conv3x3(x, weight, bias):
    """Conv2d 3x3, padding 1, stride 1 (cross-correlation, as torch does). x [C, h, w]."""
    C, h, w = x.shape
    xp = torch.zeros(C, h + 2, w + 2, dtype=F64)
    xp[:, 1:-1, 1:-1] = x
    out = bias[:, None, None].expand(weight.shape[0], h, w).clone()
    for dy in range(3):
        for dx in range(3):
            out += torch.einsum("oc,chw->ohw", weight[:, :, dy, dx], xp[:, dy:dy + h, dx:dx + w])
    return out


def rotate_pair(out, src, i, j, angle):
    """Channels (i, j) of the last dim: (a, b) -> (a cos - b sin, b cos + a sin).
    `angle` is [N] and broadcast over any middle dims."""
    shape = (-1,) + (1,) * (src.dim() - 2)
    c, s = torch.cos(angle).reshape(shape), torch.sin(angle).reshape(shape)
    a, b = src[..., i], src[..., j]
    out[..., i] = a * c - b * s
    out[..., j] = b * c + a * s


# --------------------------------------------------------------------------- schedule, noise

def shifted_timesteps(steps, shift):
    """t_k = 1 - sigma'(1 - k/N) with sigma' = shift s / (1 + (shift - 1) s), written as one fraction."""
    return [(k / steps) / (1.0 + (shift - 1.0) * (1.0 - k / steps)) for k in range(steps + 1)]


def noise_scale(m: RefModel, num_tokens):
    init = m.noise_scale_init
    if m.noise_scale_mode in ("resolution", "dynamic"):
        return min(init * math.sqrt(num_tokens / m.noise_base), m.noise_max)
    if m.noise_scale_mode == "dynamic_sqrt":
        return min(math.sqrt(init * math.sqrt(num_tokens / m.noise_base)), m.noise_max)
    return min(init, m.noise_max)


def reference_noise(seed, H, W):
    """The initial noise: one randn(1,3,H,W) float32 draw on a fresh seeded CPU generator."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return torch.randn(1, 3, H, W, generator=g, dtype=torch.float32)
