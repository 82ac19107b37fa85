"""Train the demo model from a seed: `python -m demo.train --out demo/checkpoints/dense`.

Flow matching as the sampler runs it: ``x_t = t x0 + (1 - t) n`` with ``n`` the noise at the
image size's noise scale, ``t`` drawn uniformly and warped by the sampler's time shift; the
tower predicts ``x0`` (x-prediction) and the loss is on the velocity ``(x0_hat - x_t)/(1 - t)``
against ``x0 - n``. One prompt in ten is dropped to the empty prompt (``<bos>`` alone), which is
the unconditional branch classifier-free guidance uses.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from demo import shapes
from demo.model import demo_config, demo_tokenizer, init_weights, save_checkpoint, target_tokens, towers
from neopp.checkpoint_config import CheckpointConfig
from neopp.schedule import initial_noise_scale
from neopp.text.tokenizer import PAD

SHIFT = 3.0            # the sampler's timestep_shift (configs/neopp/neopp_dense.json)
LOSS_MIN_GAP = 0.05    # 1 - t floor in the loss (the sampler's is 0.02; this keeps late steps from dominating)
DROP_PROMPT = 0.1


def vocabulary() -> list[str]:
    return sorted({w for s in shapes.all_scenes() for w in s.prompt.split()})


def size_weights() -> tuple[list[tuple[int, int]], np.ndarray]:
    """Small images most often (cheap), every allowed size sometimes: weight ~ 1 / tokens."""
    sizes = list(shapes.SIZES)
    w = np.array([1.0 / ((h // 32) * (w // 32)) for h, w in sizes])
    return sizes, w / w.sum()


def sample_times(n: int, gen: torch.Generator) -> torch.Tensor:
    sigma = 1.0 - torch.rand(n, generator=gen)
    return 1.0 - SHIFT * sigma / (1.0 + (SHIFT - 1.0) * sigma)


def batch_prompts(scenes: list, tokenizer, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, S] right-padded, and each row's length (1 for a dropped prompt)."""
    rows = [tokenizer.encode(s.prompt) for s in scenes]
    drop = torch.rand(len(rows), generator=gen) < DROP_PROMPT
    rows = [r[:1] if d else r for r, d in zip(rows, drop.tolist())]
    width = max(len(r) for r in rows)
    pad = tokenizer.ids[PAD]
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    return ids, torch.tensor([len(r) for r in rows])


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    cfg, tokenizer = demo_config(), demo_tokenizer(vocabulary())
    config = CheckpointConfig.from_dict(cfg)
    params = {k: v.clone().requires_grad_(True) for k, v in init_weights(cfg, len(tokenizer.vocab), args.seed).items()}
    ema = {k: v.detach().clone() for k, v in params.items()}
    language, tower = towers(config, params, tokenizer)
    opt = torch.optim.AdamW(params.values(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    sizes, probs = size_weights()
    log, began, window = [], time.perf_counter(), []
    for step in range(args.steps):
        h, w = sizes[rng.choice(len(sizes), p=probs)]
        tokens = (h // 32) * (w // 32)
        n = max(2, args.token_budget // tokens)
        scenes, images = shapes.sample_batch(rng, n, h, w)
        x0 = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        ids, lengths = batch_prompts(scenes, tokenizer, gen)
        scale = initial_noise_scale(config, tokens)
        t = sample_times(n, gen)
        noise = torch.randn(x0.shape, generator=gen) * scale
        tb = t[:, None, None, None]
        xt = tb * x0 + (1 - tb) * noise
        pred = tower.predict(xt, t, scale, language.prefix_kv(ids), lengths)
        gap = (1 - t).clamp(min=LOSS_MIN_GAP)[:, None, None]
        z = target_tokens(xt)
        loss = ((pred - z) / gap - (target_tokens(x0) - target_tokens(noise))).square().mean()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for k, v in params.items():
                ema[k].mul_(decay).add_(v.detach(), alpha=1 - decay)
        window.append(loss.item())
        if (step + 1) % args.log_every == 0:
            log.append({"step": step + 1, "loss": float(np.mean(window)), "seconds": time.perf_counter() - began})
            window = []
            print(json.dumps(log[-1]), flush=True)
    save_checkpoint(args.out, cfg, tokenizer, ema)
    summary = {"seed": args.seed, "steps": args.steps, "token_budget": args.token_budget, "lr": args.lr,
               "threads": args.threads, "seconds": round(time.perf_counter() - began, 1), "log": log}
    (args.out / "training_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train the demo model (both towers) on the shapes grammar")
    parser.add_argument("--out", type=Path, default=Path("demo/checkpoints/dense"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--token-budget", type=int, default=384, help="image tokens per batch")
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--ema", type=float, default=0.999)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=50)
    train(parser.parse_args(argv))


if __name__ == "__main__":
    main()
