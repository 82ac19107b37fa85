"""The demo MoE: sparse upcycling of the trained dense demo model, then a short training run.

Every expert starts as the dense MLP of its layer plus a small perturbation (so the experts can
drift apart), the router starts small and random; the generation tower then trains briefly
with the dense objective. The language tower is copied and frozen, so the dense model's prompt
encoder serves the MoE models too.
"""

from __future__ import annotations

import json
import time

import torch
from safetensors.torch import load_file

from demo.model import save_checkpoint, towers
from demo.training import Batches, Schedule, fit, flow_matching_loss, run_parser, start_run
from neopp.model.checkpoint import layer_prefix
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.text.language_tower import is_language_key
from neopp.text.tokenizer import TOKENIZER_FILE, WordTokenizer

EXPERTS, TOP_K, PERTURB = 4, 2, 0.02


def upcycled(dense: dict[str, torch.Tensor], layers: int, seed: int, perturb: float = PERTURB
             ) -> dict[str, torch.Tensor]:
    """The dense tensors with each generation MLP replaced by a router and perturbed copies."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.float().clone() for k, v in dense.items()}
    for i in range(layers):
        m = layer_prefix(i) + "mlp_mot_gen."
        d = out[m + "gate_proj.weight"].shape[1]
        out[m + "gate.weight"] = torch.randn(EXPERTS, d, generator=g) * (0.1 / d ** 0.5)
        for name in ("gate_proj", "up_proj", "down_proj"):
            w = out.pop(f"{m}{name}.weight")
            for j in range(EXPERTS):
                noise = torch.randn(w.shape, generator=g) * (perturb * w.std())
                out[f"{m}experts.{j}.{name}.weight"] = w + noise
    return out


def main(argv: list[str] | None = None) -> None:
    args = run_parser(__doc__, "demo/checkpoints/moe", seed=1, steps=600, lr=2e-4).parse_args(argv)
    cfg = start_run(args)
    cfg["llm_config"].update(gen_num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True)
    config = CheckpointConfig.from_dict(cfg)
    tokenizer = WordTokenizer.from_file(args.dense / TOKENIZER_FILE)
    tensors = upcycled(load_file(str(args.dense / "model.safetensors")), config.num_layers, args.seed)
    params = {k: v.requires_grad_(not is_language_key(k)) for k, v in tensors.items()}
    trainable = {k: v for k, v in params.items() if v.requires_grad}
    language, tower = towers(config, params, tokenizer)
    batches = Batches(args.seed, args.token_budget)
    began = time.perf_counter()
    ema, log = fit(trainable, lambda: flow_matching_loss(batches, config, language, tower, tokenizer),
                   Schedule(args.steps, args.lr, warmup=50))
    save_checkpoint(args.out, cfg, tokenizer, {**{k: v.detach() for k, v in params.items()}, **ema})
    summary = {"from": str(args.dense), "experts": EXPERTS, "top_k": TOP_K, "perturbation": PERTURB,
               "seed": args.seed, "steps": args.steps, "lr": args.lr,
               "seconds": round(time.perf_counter() - began, 1), "log": log}
    (args.out / "training_log.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
