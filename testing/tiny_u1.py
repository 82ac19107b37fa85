"""A tiny SenseNova-U1 checkpoint with its prompt side: the real architecture, real key names.

Beside the generation tower of ``testing.tiny_checkpoint``, it holds the understanding tower
(``language_model.model.*`` without ``_mot_gen``: token embedding, split q/k norms, SwiGLU MLPs),
``template: neo1_0`` in ``config.json``, and a byte-level BPE ``tokenizer.json`` trained here on a
few sentences, carrying the Qwen3 / U1 special tokens at their real ids. So the embedding has a
row for id 151671 (``</img>``): the table is 151,672 rows of a narrow width, stored in bf16 as a
real checkpoint is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.trainers import BpeTrainer

from neopp.model.checkpoint import LM, layer_prefix
from neopp.text.language_tower import LM_HEAD, VISION_UND
from testing.tiny_checkpoint import write_tiny_checkpoint

REAL_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<think>": 151667,
            "</think>": 151668, "<IMG_CONTEXT>": 151669, "<img>": 151670, "</img>": 151671}
CORPUS = ["a red cat on the mat, a blue dog!", "Ünïcödé: 猫と犬 — café", "You are an image generation assistant."]
# Narrower than the generation tests' tower: the embedding has 151,672 rows.
U1_LLM = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
U1_MLP = 128


def bare_bpe() -> Tokenizer:
    """A byte-level BPE model trained on ``CORPUS``, without the special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    return tok


def write_u1_tokenizer(folder: Path, bare: Tokenizer) -> Path:
    """``tokenizer.json``: ``bare`` with the special tokens added at their real ids."""
    raw = json.loads(bare.to_str())
    raw["model"]["vocab"].update(REAL_IDS)
    raw["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True} for t, i in REAL_IDS.items()]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(raw), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 131072}), encoding="utf-8")
    return folder


def understanding_tensors(llm: dict, rows: int, seed: int) -> dict[str, torch.Tensor]:
    """The understanding tower's weights: linears ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1^2). With
    ``num_experts`` in ``llm``, a layer not in ``mlp_only_layers`` and on a ``decoder_sparse_step``
    routes over experts (``mlp.gate`` and ``mlp.experts.{j}.*``, ``moe_intermediate_size`` wide)."""
    g = torch.Generator().manual_seed(seed)
    d, hd, nh, nkv = llm["hidden_size"], llm["head_dim"], llm["num_attention_heads"], llm["num_key_value_heads"]

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) / in_f ** 0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    w = {LM + "embed_tokens.weight": torch.randn(rows, d, generator=g).to(torch.bfloat16),
         LM + "norm.weight": norm(d), LM_HEAD: linear(rows, d).to(torch.bfloat16)}  # untied, as U1-8B
    for i in range(llm["num_hidden_layers"]):
        p, a = layer_prefix(i), layer_prefix(i) + "self_attn."
        w.update({p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
                  a + "q_proj.weight": linear(nh * hd, d), a + "k_proj.weight": linear(nkv * hd, d),
                  a + "v_proj.weight": linear(nkv * hd, d), a + "o_proj.weight": linear(d, nh * hd)})
        experts = llm.get("num_experts", 0)
        if experts and i not in llm.get("mlp_only_layers", []) and (i + 1) % llm.get("decoder_sparse_step", 1) == 0:
            width = llm["moe_intermediate_size"]
            w[p + "mlp.gate.weight"] = linear(experts, d)
            for j in range(experts):
                e = f"{p}mlp.experts.{j}."
                w.update({e + "gate_proj.weight": linear(width, d), e + "up_proj.weight": linear(width, d),
                          e + "down_proj.weight": linear(d, width)})
        else:
            w.update({p + "mlp.gate_proj.weight": linear(U1_MLP, d), p + "mlp.up_proj.weight": linear(U1_MLP, d),
                      p + "mlp.down_proj.weight": linear(d, U1_MLP)})
        w.update({f"{a}{n}.weight": norm(hd // 2) for n in ("q_norm", "k_norm", "q_norm_hw", "k_norm_hw")})
    return w


def vision_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """The understanding tower's picture embedding (editing): patch conv, then the 2 x 2 merge conv."""
    g = torch.Generator().manual_seed(seed)
    dv, d, p = config["vision_config"]["hidden_size"], config["llm_config"]["hidden_size"], 16
    return {VISION_UND + "patch_embedding.weight": torch.randn(dv, 3, p, p, generator=g) / (3 * p * p) ** 0.5,
            VISION_UND + "patch_embedding.bias": 0.1 * torch.randn(dv, generator=g),
            VISION_UND + "dense_embedding.weight": torch.randn(d, dv, 2, 2, generator=g) / (4 * dv) ** 0.5,
            VISION_UND + "dense_embedding.bias": 0.1 * torch.randn(d, generator=g)}


# A3B's understanding tower in small: experts in layers 0, 1 and 3, a dense MLP in layer 2
A3B_UNDERSTANDING = {"num_hidden_layers": 4, "num_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "mlp_only_layers": [2], "decoder_sparse_step": 1, "norm_topk_prob": True}


def write_tiny_u1_checkpoint(out_dir: str | Path, seed: int = 0, vision: bool = True, a3b: bool = False) -> Path:
    """A tiny checkpoint that draws and encodes its own prompts (and edits, with ``vision``);
    ``a3b``: both towers route over experts, as SenseNova-U1-A3B's do."""
    llm = {**U1_LLM, **A3B_UNDERSTANDING} if a3b else U1_LLM
    out = write_tiny_checkpoint(out_dir, "moe" if a3b else "dense", seed,
                                overrides={"template": "neo1_0", "llm_config": llm})
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    tensors.update(understanding_tensors(config["llm_config"], max(REAL_IDS.values()) + 1, seed + 1))
    if vision:
        tensors.update(vision_tensors(config, seed + 2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    write_u1_tokenizer(out, bare_bpe())
    return out
