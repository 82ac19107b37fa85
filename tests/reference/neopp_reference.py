"""Independent float64 reference of NeoPP: the tower, the shifted schedule and the noise draw.

Written from the model's description alone, without looking at the runner's modules, so that
the two can be compared.  Plain loops and explicit formulas; speed does not
matter (tiny checkpoints only).  Every tensor here is float64.

Readings taken where the description leaves room (each one is also what the runner is
tested against):
* "GELU" in the heads is the exact (erf) GELU, like the patch embedding's.
* Grouped-query attention: query head n uses KV head n // (NH / NKV)
  (consecutive query heads share one KV head).
* The time `t` that decides guidance, that is fed to the timestep embedder and
  that divides the velocity is the step's start time t_k' (shifted).
* The noise-scale embedder gets noise_scale / noise_scale_max_value, where
  noise_scale is the initial-noise scale of this image size; it is skipped when
  `add_noise_scale_embedding` is false.
* Initial noise scale, every mode capped at noise_scale_max_value: "resolution" (and
  its alias "dynamic") init * sqrt(tokens / base); "dynamic_sqrt" the square root of
  that; "constant", like any other name, init alone.
* One RMSNorm epsilon, llm_config.rms_norm_eps (1e-6 when absent), for every norm of
  the tower; MoE sizes from gen_num_experts / gen_num_experts_per_tok, each falling
  back to num_experts / num_experts_per_tok.
"""

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
                    used = key.startswith("fm_modules.") or (
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
    out = []
    for k in range(steps + 1):
        sigma = 1.0 - k / steps
        sigma = shift * sigma / (1.0 + (shift - 1.0) * sigma)
        out.append(1.0 - sigma)
    return out


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


# --------------------------------------------------------------------------- tokens in

def vision_rope(e, rows, cols, theta):
    """e [N, DV]; first half rotated by column index, second by row; interleaved pairs."""
    DV = e.shape[1]
    half = DV // 2
    out = e.clone()
    for j in range(DV // 4):
        f = 1.0 / theta ** (2 * j / half)
        rotate_pair(out, e, 2 * j, 2 * j + 1, cols * f)
        rotate_pair(out, e, half + 2 * j, half + 2 * j + 1, rows * f)
    return out


def sinusoid(t):
    j = torch.arange(128, dtype=F64)
    f = torch.exp(-math.log(10000.0) * j / 128)
    return torch.cat([torch.cos(t * f), torch.sin(t * f)])


def embedder(m, name, value):
    h = linear(sinusoid(value), m[f"fm_modules.{name}.mlp.0.weight"], m[f"fm_modules.{name}.mlp.0.bias"])
    return linear(silu(h), m[f"fm_modules.{name}.mlp.2.weight"], m[f"fm_modules.{name}.mlp.2.bias"])


def tokens_in(m, img, t, nscale):
    _, H, W = img.shape
    gh, gw = H // P, W // P
    pre = "fm_modules.vision_model_mot_gen.embeddings."
    pw = m[pre + "patch_embedding.weight"]  # [DV, 3, 16, 16]
    e = gelu(linear(cut(img, P, channel_last=False), pw.reshape(pw.shape[0], -1), m[pre + "patch_embedding.bias"]))
    rows = torch.tensor([r for r in range(gh) for _ in range(gw)], dtype=F64)
    cols = torch.tensor([c for _ in range(gh) for c in range(gw)], dtype=F64)
    e = vision_rope(e, rows, cols, m.rope_theta_vision)
    grid = e.reshape(gh, gw, -1)
    dw, db = m[pre + "dense_embedding.weight"], m[pre + "dense_embedding.bias"]  # [D, DV, 2, 2]
    tok = []
    for r in range(gh // M):
        for c in range(gw // M):
            acc = db.clone()
            for di in range(M):
                for dj in range(M):
                    acc = acc + dw[:, :, di, dj] @ grid[M * r + di, M * c + dj]
            tok.append(acc)
    hid = torch.stack(tok)
    add = embedder(m, "timestep_embedder", t)
    if m.add_noise_embedding:
        add = add + embedder(m, "noise_scale_embedder", nscale / m.noise_max)
    return hid + add


# --------------------------------------------------------------------------- decoder layer

def rope3d(x, offset, rows, cols, theta, theta_hw):
    """x [L, heads, HD]; rotate-half inside the temporal / row / column segments."""
    HD = x.shape[-1]
    out = x.clone()
    ones = torch.ones(x.shape[0], dtype=F64)
    for i in range(HD // 4):
        rotate_pair(out, x, i, i + HD // 4, ones * offset / theta ** (4 * i / HD))
    for i in range(HD // 8):
        fs = 1.0 / theta_hw ** (8 * i / HD)
        rotate_pair(out, x, HD // 2 + i, HD // 2 + i + HD // 8, rows * fs)
        rotate_pair(out, x, 3 * HD // 4 + i, 3 * HD // 4 + i + HD // 8, cols * fs)
    return out


def head_norm(x, w_t, w_hw, eps):
    HD = x.shape[-1]
    return torch.cat([rmsnorm(x[..., :HD // 2], w_t, eps), rmsnorm(x[..., HD // 2:], w_hw, eps)], dim=-1)


def swiglu(b, gate, up, down):
    return linear(silu(linear(b, gate)) * linear(b, up), down)


def mlp(m, i, b):
    if m.num_experts == 0:
        return swiglu(b, m.layer(i, "mlp_mot_gen.gate_proj.weight"), m.layer(i, "mlp_mot_gen.up_proj.weight"),
                      m.layer(i, "mlp_mot_gen.down_proj.weight"))
    logits = linear(b, m.layer(i, "mlp_mot_gen.gate.weight"))  # [L, E]
    out = torch.zeros_like(b)
    for n in range(b.shape[0]):
        if m.norm_topk_prob:
            top = torch.topk(logits[n], m.top_k)
            weights = softmax(top.values)
        else:
            top = torch.topk(softmax(logits[n]), m.top_k)
            weights = top.values
        for wgt, e in zip(weights, top.indices.tolist()):
            ex = f"mlp_mot_gen.experts.{e}."
            out[n] += wgt * swiglu(b[n], m.layer(i, ex + "gate_proj.weight"), m.layer(i, ex + "up_proj.weight"),
                                   m.layer(i, ex + "down_proj.weight"))
    return out


def decoder_layer(m, i, hid, kv, offset, rows, cols):
    L = hid.shape[0]
    a = rmsnorm(hid, m.layer(i, "input_layernorm_mot_gen.weight"), m.eps)
    q = linear(a, m.layer(i, "self_attn.q_proj_mot_gen.weight")).reshape(L, m.NH, m.HD)
    k = linear(a, m.layer(i, "self_attn.k_proj_mot_gen.weight")).reshape(L, m.NKV, m.HD)
    v = linear(a, m.layer(i, "self_attn.v_proj_mot_gen.weight")).reshape(L, m.NKV, m.HD)
    q = head_norm(q, m.layer(i, "self_attn.q_norm_mot_gen.weight"), m.layer(i, "self_attn.q_norm_hw_mot_gen.weight"),
                  m.eps)
    k = head_norm(k, m.layer(i, "self_attn.k_norm_mot_gen.weight"), m.layer(i, "self_attn.k_norm_hw_mot_gen.weight"),
                  m.eps)
    q = rope3d(q, offset, rows, cols, m.rope_theta, m.rope_theta_hw)
    k = rope3d(k, offset, rows, cols, m.rope_theta, m.rope_theta_hw)
    K = torch.cat([kv[i, 0].to(F64), k])  # [S+L, NKV, HD]
    V = torch.cat([kv[i, 1].to(F64), v])
    group = m.NH // m.NKV
    att = torch.zeros(L, m.NH, m.HD, dtype=F64)
    for n in range(m.NH):
        kvh = n // group
        scores = (q[:, n] @ K[:, kvh].T) * m.HD ** -0.5  # [L, S+L], no mask
        att[:, n] = softmax(scores) @ V[:, kvh]
    hid = hid + linear(att.reshape(L, m.NH * m.HD), m.layer(i, "self_attn.o_proj_mot_gen.weight"))
    b = rmsnorm(hid, m.layer(i, "post_attention_layernorm_mot_gen.weight"), m.eps)
    return hid + mlp(m, i, b)


# --------------------------------------------------------------------------- head, velocity

def head(m, hid, h, w):
    if not m.use_pixel_head:
        y = gelu(linear(hid, m["fm_modules.fm_head.0.weight"], m["fm_modules.fm_head.0.bias"]))
        return linear(y, m["fm_modules.fm_head.2.weight"], m["fm_modules.fm_head.2.bias"])
    grid = hid.T.reshape(m.D, h, w)  # token r*w+c -> [:, r, c]
    y = pixel_shuffle(grid, 2)
    y = gelu(conv3x3(y, m["fm_modules.fm_head.conv1.weight"], m["fm_modules.fm_head.conv1.bias"]))
    y = pixel_shuffle(y, 2)
    y = conv3x3(y, m["fm_modules.fm_head.conv2.weight"], m["fm_modules.fm_head.conv2.bias"])
    img = pixel_shuffle(y, 8)  # [3, H, W]
    return cut(img, T, channel_last=True)


def reference_velocity(ckpt, kv_online, offset, x, t, H, W):
    """Velocity [L, T*T*3] (float64) of one branch at state x [1,3,H,W], time t."""
    m = as_model(ckpt)
    assert kv_online.shape[0] == m.NL and kv_online.shape[1] == 2
    assert kv_online.shape[3] == m.NKV and kv_online.shape[4] == m.HD
    h, w = H // T, W // T
    img = x.to(F64).reshape(3, H, W)
    hid = tokens_in(m, img, float(t), noise_scale(m, h * w))
    rows = torch.tensor([r for r in range(h) for _ in range(w)], dtype=F64)
    cols = torch.tensor([c for _ in range(h) for c in range(w)], dtype=F64)
    for i in range(m.NL):
        hid = decoder_layer(m, i, hid, kv_online, float(offset), rows, cols)
    hid = rmsnorm(hid, m["language_model.model.norm_mot_gen.weight"], m.eps)
    x_pred = head(m, hid, h, w)
    z = cut(img, T, channel_last=True)
    return (x_pred - z) / max(1.0 - float(t), 0.02)


# --------------------------------------------------------------------------- guidance, sampling

def combine(v_c, v_u, scale, norm):
    v = v_u + scale * (v_c - v_u)
    if norm == "global":
        ratio = torch.linalg.vector_norm(v_c) / (torch.linalg.vector_norm(v) + 1e-8)
        return v * ratio.clamp(0.0, 1.0)
    if norm == "channel":
        ratio = torch.linalg.vector_norm(v_c, dim=-1, keepdim=True) / (
            torch.linalg.vector_norm(v, dim=-1, keepdim=True) + 1e-8)
        return v * ratio.clamp(0.0, 1.0)
    if norm == "none":
        return v
    raise ValueError(f"unknown cfg_norm {norm!r}")


def uses_guidance(t, enable_cfg, cfg_scale, cfg_interval):
    return bool(enable_cfg and cfg_interval[0] <= t <= cfg_interval[1] and cfg_scale > 1)


def reference_generate(ckpt, cond_kv, uncond_kv, off_c, off_u, H, W, noise_unscaled, steps, shift,
                       cfg_scale, cfg_interval, cfg_norm, enable_cfg, predictions=None):
    """Whole generation; returns the final x, float64 [1, 3, H, W].

    ``predictions``, a list, receives each step's clean-image estimate [1, 3, H, W]: the state
    moved all the way to t = 1 along that step's (guided) velocity, z + max(1 - t, 0.02) * v.
    """
    m = as_model(ckpt)
    if cfg_norm not in ("global", "channel", "none"):
        raise ValueError(f"unknown cfg_norm {cfg_norm!r}")
    ts = shifted_timesteps(steps, shift)
    x = noise_scale(m, (H // T) * (W // T)) * noise_unscaled.to(F64).reshape(1, 3, H, W)
    for k in range(steps):
        t = ts[k]
        v = reference_velocity(m, cond_kv, off_c, x, t, H, W)
        if uses_guidance(t, enable_cfg, cfg_scale, cfg_interval):
            v_u = reference_velocity(m, uncond_kv, off_u, x, t, H, W)
            v = combine(v, v_u, cfg_scale, cfg_norm)
        if predictions is not None:
            predictions.append(uncut_channel_last(cut(x[0], T, channel_last=True) + max(1.0 - t, 0.02) * v,
                                                  H, W, T)[None])
        z = cut(x[0], T, channel_last=True) + (ts[k + 1] - t) * v
        x = uncut_channel_last(z, H, W, T)[None]
    return x


def reference_pixels(x):
    """Final x [1,3,H,W] -> uint8 HWC, round(clamp(x*0.5+0.5, 0, 1) * 255)."""
    y = (x[0].to(F64) * 0.5 + 0.5).clamp(0.0, 1.0) * 255.0
    return torch.round(y).to(torch.uint8).permute(1, 2, 0).numpy()
