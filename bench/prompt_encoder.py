"""The prompt encoder at the 8B geometry: prefill time per token, batched prefill, the cached
unconditional prefix.

A slice of U1-8B's understanding tower (hidden 4096, 32 heads, 8 KV heads, head dim 128, MLP
12288; ``--layers`` of its 36) with random weights, run the way ``neopp_prompt_encoder`` runs it
on a CPU (float32). Per-layer figures scale to 36 layers by 36 / layers. Three comparisons, each
measured side by side in this run:

* one prompt's prefill at several lengths: milliseconds per token;
* N different prompts of the conditional prefix's length (300 tokens) prefilled together, as the
  encoder's owner does with prompts that arrive together (``LanguageTower.encode_many``: one
  matrix product per weight for all, attention per prompt), against N forwards of one each;
* the unconditional prefix (12 tokens, no negative prompt) computed per request against taken
  from the encoder's cache;
* an edit with one 1024x1024 picture (1024 image tokens): its picture embedding, its conditional
  prefix (the picture among 300 text tokens) and its image-only prefix.

    python -m bench.prompt_encoder [--layers 2] [--repeats 3] [--out bench]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import section_main, stats, timed
from neopp.model.checkpoint import LM, layer_prefix
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.text.edit_images import Picture
from neopp.text.language_tower import EMBED, VISION_KEYS, LanguageTower
from neopp.text.prompt_ids import PromptIds

U1_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
         "rope_theta": 5_000_000.0, "rope_theta_hw": 10_000.0}
MLP = 12288
VOCAB = 4096  # the prefill does not depend on the table's size (a lookup per token)
COND_TOKENS, UNCOND_TOKENS = 300, 12  # the U1 template with a short prompt; its empty unconditional turn
LENGTHS = (64, 300, 1000)
PICTURE_TOKEN, PICTURE_SIDE = VOCAB - 1, 1024
BATCHES = (1, 4, 16)


class FixedIds(PromptIds):
    """Prompts whose ids are given (the bench measures the tower, not the tokenizer)."""

    kind = "bench ids"

    def conditional(self, prompt: str) -> list[int]:
        return list(range(1, COND_TOKENS + 1))

    def unconditional(self, negative_prompt: str) -> list[int]:
        return list(range(1, UNCOND_TOKENS + 1))

    def vocabulary_size(self) -> int:
        return VOCAB

    def picture_token(self) -> int:
        return PICTURE_TOKEN

    def positions(self, ids: list[int], grids: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """Text before and after one picture, which takes one temporal index."""
        (rows, cols), first = grids[0], ids.index(PICTURE_TOKEN)
        return ([(t, 0, 0) for t in range(first)] + [(first, r, c) for r in range(rows) for c in range(cols)]
                + [(first + 1 + i, 0, 0) for i in range(len(ids) - first - rows * cols)])


def slice_tower(layers: int) -> LanguageTower:
    vision = {"hidden_size": 1024, "rope_theta_vision": 10_000.0, "max_position_embeddings_vision": 1024}
    raw = {"llm_config": {**U1_8B, "num_hidden_layers": layers}, "vision_config": vision}
    config = CheckpointConfig.from_dict(raw)
    d, hd = U1_8B["hidden_size"], U1_8B["head_dim"]
    q, kv = U1_8B["num_attention_heads"] * hd, U1_8B["num_key_value_heads"] * hd
    gen = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    tensors = {EMBED: torch.randn(VOCAB, d, generator=gen)}
    for i in range(layers):
        p, a = layer_prefix(i), layer_prefix(i) + "self_attn."
        tensors.update({p + "input_layernorm.weight": torch.ones(d),
                        p + "post_attention_layernorm.weight": torch.ones(d), a + "q_proj.weight": w(q, d),
                        a + "k_proj.weight": w(kv, d), a + "v_proj.weight": w(kv, d),
                        a + "o_proj.weight": w(d, q), p + "mlp.gate_proj.weight": w(MLP, d),
                        p + "mlp.up_proj.weight": w(MLP, d), p + "mlp.down_proj.weight": w(d, MLP)})
        tensors.update({f"{a}{n}.weight": torch.ones(hd // 2) for n in ("q_norm", "k_norm", "q_norm_hw", "k_norm_hw")})
    assert all(k.startswith(LM) for k in tensors)
    dv = vision["hidden_size"]
    tensors.update(dict(zip(VISION_KEYS, (w(dv, 3, 16, 16), torch.zeros(dv), w(d, dv, 2, 2), torch.zeros(d)),
                            strict=True)))
    return LanguageTower.from_tensors(config, tensors, FixedIds(), torch.device("cpu"), torch.float32)


def edit_rows(tower: LanguageTower, r: int, scale: float) -> list[str]:
    """One picture's embedding, then the two prefixes it sits in."""
    pixels = torch.randn(1, 3, PICTURE_SIDE, PICTURE_SIDE, generator=torch.Generator().manual_seed(1))
    picture = Picture(pixels)
    embed = stats(timed(lambda: tower.embed_pictures((picture,)), r))
    pictures = tower.embed_pictures((picture,))
    tokens = picture.num_tokens
    rows = [f"| picture embedding ({PICTURE_SIDE}x{PICTURE_SIDE}, {tokens} tokens) | {embed[0] * 1e3:.0f} | "
            f"{embed[0] * 1e3:.0f} (not per layer) |"]
    for name, before, after in (("conditional prefix", COND_TOKENS - 10, 10), ("image-only prefix", 12, 4)):
        seq = list(range(1, before + 1)) + [PICTURE_TOKEN] * tokens + list(range(1, after + 1))
        med = stats(timed(lambda s=seq: tower.encode_with_pictures(s, pictures), r))[0]
        rows.append(f"| {name} ({before + after} text + {tokens} picture tokens) | {med * 1e3:.0f} | "
                    f"{med * scale:.1f} s |")
    return rows


def ids(batch: int, length: int) -> torch.Tensor:
    return torch.arange(1, length + 1).repeat(batch, 1)


def body(args: argparse.Namespace) -> str:
    tower, r = slice_tower(args.layers), args.repeats
    scale = 36 / args.layers
    lines = [f"Geometry: U1-8B's understanding tower, {args.layers} of its 36 layers (hidden 4096, 32 heads, 8 KV "
             f"heads, head dim 128, MLP {MLP}), random float32 weights, as `neopp_prompt_encoder` runs on a CPU. "
             f"Times: median (min-max) of {r}; the 36-layer column multiplies by {scale:g}.", "",
             "### One prompt's prefill", "", "| tokens | ms | ms per token | 36 layers: s |", "|---|---|---|---|"]
    with torch.inference_mode():
        for length in LENGTHS:
            med, lo, hi = stats(timed(lambda n=length: tower.prefix_kv(ids(1, n)), r))
            lines.append(f"| {length} | {med * 1e3:.0f} ({lo * 1e3:.0f}-{hi * 1e3:.0f}) | {med * 1e3 / length:.2f} "
                         f"| {med * scale:.1f} |")
        lines += ["", f"### {COND_TOKENS}-token prompts: one forward for N against N forwards", "",
                  "| N | N forwards s | one forward s | speed-up | prompts/s, one forward (36 layers) |",
                  "|---|---|---|---|---|"]
        for n in BATCHES:
            prompts = [[1 + (i + j) % (VOCAB - 2) for j in range(COND_TOKENS)] for i in range(n)]  # n different
            apart = stats(timed(lambda p=prompts: [tower.encode_ids(one) for one in p], r))[0]
            together = stats(timed(lambda p=prompts: tower.encode_many(p), r))[0]
            lines.append(f"| {n} | {apart:.2f} | {together:.2f} | {apart / together:.2f}x | "
                         f"{n / (together * scale):.2f} |")
        computed = stats(timed(lambda: tower.encode_ids(tower.prompt_ids.unconditional("")), r))
        cond = stats(timed(lambda: tower.conditional(""), r))[0]
        tower.unconditional("")
        cached = stats(timed(lambda: tower.unconditional(""), r))
        edit = edit_rows(tower, r, scale)
    lines += ["", "### The unconditional prefix", "",
              "| unconditional prefix | ms (36 layers; the cache's lookup does not grow with them) | share of a "
              "request's encoding |", "|---|---|---|",
              f"| computed per request ({UNCOND_TOKENS} tokens) | {computed[0] * 1e3 * scale:.1f} | "
              f"{computed[0] / (cond + computed[0]):.1%} |",
              f"| taken from the cache | {cached[0] * 1e3:.4f} | {cached[0] / (cond * scale + cached[0]):.4%} |",
              "", "The middle table is what the encoder's owner does with prompts that arrive together on "
              "its instances (up to `max_prefill_batch`); a lone prompt takes the one-forward path of N = 1.",
              "", "### An edit with one picture", "", "| work | ms | 36 layers |", "|---|---|---|", *edit,
              "", "An edit's encoding is the picture's embedding and both prefixes; its unconditional prefix "
              "is the cached one."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    section_main(argv, __doc__, "prompt_encoder.md", "Prompt encoder at the 8B geometry", body, layers=2, repeats=3)


if __name__ == "__main__":
    main()
