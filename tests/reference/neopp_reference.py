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

import torch

# The building blocks and the tower live beside this file; tests reach them through this module.
from tests.reference.reference_ops import (
    F64,
    RefModel,
    T,
    as_model,
    conv3x3,
    cut,
    gelu,
    linear,
    noise_scale,
    pixel_shuffle,
    reference_noise,
    rmsnorm,
    rotate_pair,
    shifted_timesteps,
    silu,
    softmax,
    uncut_channel_last,
)
from tests.reference.reference_tower import head_norm, reference_velocity, rope3d

__all__ = ["F64", "RefModel", "as_model", "conv3x3", "cut", "gelu", "head_norm", "linear", "noise_scale",
           "pixel_shuffle", "reference_noise", "reference_velocity", "rmsnorm", "rope3d", "rotate_pair",
           "shifted_timesteps", "silu", "softmax", "uncut_channel_last"]

# --------------------------------------------------------------------------- guidance, sampling

def combine(v_c, v_u, scale, norm):
    return clamp_to_cond(v_u + scale * (v_c - v_u), v_c, norm)


def clamp_to_cond(v, v_c, norm):
    """Scale the guided v down (never up) to the norm of the cond velocity."""
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
                       cfg_scale, cfg_interval, cfg_norm, enable_cfg, previews=None):
    """Whole generation; returns the final x, float64 [1, 3, H, W].

    ``previews``, a list, receives after each step the clean image the step's (guided)
    velocity points at, x + max(1 - t, 0.02) v, as [1, 3, H, W]."""
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
        if previews is not None:
            x_pred = cut(x[0], T, channel_last=True) + max(1.0 - t, 0.02) * v
            previews.append(uncut_channel_last(x_pred, H, W, T)[None])
        z = cut(x[0], T, channel_last=True) + (ts[k + 1] - t) * v
        x = uncut_channel_last(z, H, W, T)[None]
    return x


# --------------------------------------------------------------------------- image editing (three branches)
# Branches: cond = prompt + input images, uncond = empty prompt (no image), image = the input
# images without the prompt.  s = cfg_scale, s_img = image_guidance_scale.

def image_step_is_guided(t, enable_cfg, s, s_img, cfg_interval):
    """Open interval (low < t < high), or every step when low is exactly 0; never when both scales are 1."""
    if not enable_cfg or (s == 1 and s_img == 1):
        return False
    low, high = cfg_interval
    return (low < t < high) or low == 0


def image_step_branches(s, s_img):
    """The branches a guided image-editing step evaluates besides cond."""
    if s_img == 1:
        return ["image"]
    if s == s_img:
        return ["uncond"]
    return ["uncond", "image"]


def image_guided_velocity(v, s, s_img, norm):
    """v: branch name -> velocity.  The formula of each case, then the clamp when a scale exceeds 1."""
    v_c = v["cond"]
    if s_img == 1:
        out = v["image"] + s * (v_c - v["image"])
    elif s == s_img:
        out = v["uncond"] + s * (v_c - v["uncond"])
    else:
        out = v["uncond"] + s * (v_c - v["image"]) + s_img * (v["image"] - v["uncond"])
    if s > 1 or s_img > 1:
        return clamp_to_cond(out, v_c, norm)
    return out


def reference_generate_image_edit(ckpt, prefixes, H, W, noise_unscaled, steps, shift, s, s_img,
                                  cfg_interval, cfg_norm, enable_cfg):
    """Whole image-editing generation.  prefixes: name -> (kv_online, offset).
    Returns the final x (float64 [1, 3, H, W]) and, per step, the branches it evaluated."""
    m = as_model(ckpt)
    ts = shifted_timesteps(steps, shift)
    x = noise_scale(m, (H // T) * (W // T)) * noise_unscaled.to(F64).reshape(1, 3, H, W)
    ran = []
    for k in range(steps):
        t = ts[k]
        names = ["cond"]
        if image_step_is_guided(t, enable_cfg, s, s_img, cfg_interval):
            names += image_step_branches(s, s_img)
        v = {name: reference_velocity(m, prefixes[name][0], prefixes[name][1], x, t, H, W) for name in names}
        step_v = v["cond"] if len(names) == 1 else image_guided_velocity(v, s, s_img, cfg_norm)
        z = cut(x[0], T, channel_last=True) + (ts[k + 1] - t) * step_v
        x = uncut_channel_last(z, H, W, T)[None]
        ran.append(names)
    return x, ran


def reference_pixels(x):
    """Final x [1,3,H,W] -> uint8 HWC, round(clamp(x*0.5+0.5, 0, 1) * 255)."""
    y = (x[0].to(F64) * 0.5 + 0.5).clamp(0.0, 1.0) * 255.0
    return torch.round(y).to(torch.uint8).permute(1, 2, 0).numpy()
