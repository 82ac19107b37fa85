"""The float64 reference's tower: image tokens in, the decoder layers over a KV prefix, the head,
and one branch's velocity (see neopp_reference)."""

from __future__ import annotations

import math

import torch

from tests.reference.reference_ops import (
    F64,
    M,
    P,
    T,
    as_model,
    conv3x3,
    cut,
    gelu,
    linear,
    noise_scale,
    pixel_shuffle,
    rmsnorm,
    rotate_pair,
    silu,
    softmax,
)

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
    hid = picture_tokens(m, img, "fm_modules.vision_model_mot_gen.embeddings.")
    add = embedder(m, "timestep_embedder", t)
    if m.add_noise_embedding:
        add = add + embedder(m, "noise_scale_embedder", nscale / m.noise_max)
    return hid + add


def picture_tokens(m, img, pre):
    """img [3, H, W] through the patch embedding under ``pre`` (the generation tower's, or the
    understanding tower's for an edit's input pictures): [H/32 * W/32, D], row-major."""
    _, H, W = img.shape
    gh, gw = H // P, W // P
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
    return torch.stack(tok)


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
