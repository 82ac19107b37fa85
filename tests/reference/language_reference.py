"""Independent float64 reference of the language tower's KV prefix, from its description.

Causal self-attention over the prompt tokens (an edit's picture tokens also see each other); keys
stored after the split q/k norm and the 3-D RoPE (text: temporal = token index, row = column = 0),
values as projected.
Plain loops, every tensor float64.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.reference.neopp_reference import F64, head_norm, linear, rmsnorm, rope3d, silu, softmax

LM = "language_model.model."
IMG_CONTEXT_ID = 151669  # Qwen3's <IMG_CONTEXT>


def reference_prefix(ckpt_dir: Path, ids: list[int]) -> torch.Tensor:
    """[NL, 2, S, NKV, HD] float64 for one prompt's token ids."""
    return reference_forward(ckpt_dir, ids)[0]


def reference_think(ckpt_dir: Path, query: list[int], tail: list[int], think_close: int, end_of_turn: int,
                    cap: int) -> tuple[list[int], list[int]]:
    """Think mode as the official rule states it: from the query, write the argmax of the next
    token's logits (the final norm, then lm_head) until ``</think>`` (kept), the end of the
    turn (not kept) or ``cap`` tokens, then the tail. Returns (the whole prefix's ids, the
    reasoning's ids). Every step runs the whole sequence again: slow, plain, float64."""
    ids, written = list(query), []
    for _ in range(cap):
        token = int(torch.argmax(reference_forward(ckpt_dir, ids)[2]))
        if token == end_of_turn:
            break
        written.append(token)
        ids.append(token)
        if token == think_close:
            break
    return ids + list(tail), written


def reference_forward(ckpt_dir: Path, ids: list[int], positions: torch.Tensor | None = None,
                      pictures: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(prefix [NL, 2, S, NKV, HD], last hidden state, next-token logits or None without a head).
    ``positions`` [S, 3] (t, h, w), text positions by default; ``pictures`` [n, D] take the place of
    the ``<IMG_CONTEXT>`` tokens, in order. Token s sees token j when j <= s or both share t."""
    raw = json.loads((Path(ckpt_dir) / "config.json").read_text())["llm_config"]
    w = {k: v.to(F64) for k, v in load_file(str(Path(ckpt_dir) / "model.safetensors")).items()}
    NL, NH, NKV, HD = raw["num_hidden_layers"], raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    eps, S = float(raw.get("rms_norm_eps", 1e-6)), len(ids)
    if positions is None:
        positions = torch.stack([torch.arange(S), torch.zeros(S), torch.zeros(S)], dim=1)
    t_pos, h_pos, w_pos = (positions[:, i].to(F64) for i in range(3))
    hid = w[LM + "embed_tokens.weight"][ids]
    if pictures is not None:
        hid[torch.tensor(ids) == IMG_CONTEXT_ID] = pictures.to(F64)
    out = torch.zeros(NL, 2, S, NKV, HD, dtype=F64)
    for i in range(NL):
        p = f"{LM}layers.{i}."
        a = rmsnorm(hid, w[p + "input_layernorm.weight"], eps)
        q = linear(a, w[p + "self_attn.q_proj.weight"]).reshape(S, NH, HD)
        k = linear(a, w[p + "self_attn.k_proj.weight"]).reshape(S, NKV, HD)
        v = linear(a, w[p + "self_attn.v_proj.weight"]).reshape(S, NKV, HD)
        q = head_norm(q, w[p + "self_attn.q_norm.weight"], w[p + "self_attn.q_norm_hw.weight"], eps)
        k = head_norm(k, w[p + "self_attn.k_norm.weight"], w[p + "self_attn.k_norm_hw.weight"], eps)
        q = rope3d(q, t_pos, h_pos, w_pos, raw["rope_theta"], raw["rope_theta_hw"])
        k = rope3d(k, t_pos, h_pos, w_pos, raw["rope_theta"], raw["rope_theta_hw"])
        out[i, 0], out[i, 1] = k, v
        att = torch.zeros(S, NH, HD, dtype=F64)
        for n in range(NH):
            kvh = n // (NH // NKV)
            for s in range(S):  # token s sees tokens 0..s, and those that share its t (a picture)
                seen = (torch.arange(S) <= s) | (t_pos == t_pos[s])
                scores = (q[s, n] @ k[seen, kvh].T) * HD ** -0.5
                att[s, n] = softmax(scores) @ v[seen, kvh]
        hid = hid + linear(att.reshape(S, NH * HD), w[p + "self_attn.o_proj.weight"])
        b = rmsnorm(hid, w[p + "post_attention_layernorm.weight"], eps)
        hid = hid + (routed_mlp(b, w, p + "mlp.", raw) if routes(raw, i) else swiglu(b, w, p + "mlp."))
    if LM + "norm.weight" not in w:
        return out, hid[-1], None
    head = w.get("language_model.lm_head.weight", w[LM + "embed_tokens.weight"])
    return out, hid[-1], linear(rmsnorm(hid[-1:], w[LM + "norm.weight"], eps), head)[0]


def swiglu(x: torch.Tensor, w: dict, m: str) -> torch.Tensor:
    gated = silu(linear(x, w[m + "gate_proj.weight"])) * linear(x, w[m + "up_proj.weight"])
    return linear(gated, w[m + "down_proj.weight"])


def routes(raw: dict, layer: int) -> bool:
    """The official Qwen3-MoE rule: experts where ``num_experts`` is set, unless the layer is in
    ``mlp_only_layers`` or off the ``decoder_sparse_step``."""
    return raw.get("num_experts", 0) > 0 and layer not in (raw.get("mlp_only_layers") or []) \
        and (layer + 1) % (raw.get("decoder_sparse_step") or 1) == 0


def routed_mlp(x: torch.Tensor, w: dict, m: str, raw: dict) -> torch.Tensor:
    """Per token: softmax over the router's scores, the top ``num_experts_per_tok`` experts,
    their weights renormalised to sum to 1 (``norm_topk_prob``), the weighted sum of their SwiGLUs."""
    out = torch.zeros_like(x)
    for s in range(x.shape[0]):
        probs = softmax(linear(x[s:s + 1], w[m + "gate.weight"])[0])
        top = sorted(range(len(probs)), key=lambda j: -float(probs[j]))[:raw["num_experts_per_tok"]]
        total = sum(float(probs[j]) for j in top) if raw.get("norm_topk_prob", True) else 1.0
        for j in top:
            out[s] += float(probs[j]) / total * swiglu(x[s:s + 1], w, f"{m}experts.{j}.")[0]
    return out
