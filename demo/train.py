"""Train the demo model from a seed: ``python -m demo.train`` (``make train-demo`` runs all three).

Flow matching as the sampler runs it: ``x_t = t x0 + (1 - t) n`` with ``n`` the noise at the
image size's noise scale, ``t`` drawn uniformly and warped by the sampler's time shift; the
tower predicts ``x0`` (x-prediction) and the loss is on the velocity ``(x0_hat - x_t)/(1 - t)``
against ``x0 - n``. One prompt in ten is dropped to the empty prompt (``<bos>`` alone), which is
the unconditional branch classifier-free guidance uses. Both towers train together.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from demo.model import NOISE, demo_config, demo_tokenizer, init_weights, load_demo, save_checkpoint, towers
from demo.shapes import LAYOUT, Layout
from demo.training import SIZE_POWER, Batches, Schedule, fit, flow_matching_loss, vocabulary
from neopp.model.checkpoint_config import CheckpointConfig


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    cfg, tokenizer = demo_config(pixel_head=args.head == "pixel"), demo_tokenizer(vocabulary())
    cfg["noise_scale_mode"] = args.noise_scale_mode
    config = CheckpointConfig.from_dict(cfg)
    start = load_demo(args.init)[2] if args.init else init_weights(cfg, len(tokenizer.vocab), args.seed)
    params = {k: v.to(args.device).requires_grad_(True) for k, v in start.items()}
    language, tower = towers(config, params, tokenizer)
    layout = Layout(tuple(args.side_range), args.jitter)
    batches = Batches(args.seed, args.token_budget, size_power=args.size_power, layout=layout)
    began = time.perf_counter()
    ema, log = fit(params, lambda: flow_matching_loss(batches, config, language, tower, tokenizer, args.weight_floor),
                   Schedule(args.steps, args.lr, args.warmup, args.ema, args.log_every))
    save_checkpoint(args.out, cfg, tokenizer, ema)
    summary = {"seed": args.seed, "head": args.head, "size_power": args.size_power, "steps": args.steps,
               "side_range": list(args.side_range), "jitter": args.jitter,
               "noise_scale_mode": args.noise_scale_mode,
               "init": str(args.init) if args.init else None, "weight_floor": args.weight_floor,
               "token_budget": args.token_budget, "lr": args.lr, "threads": args.threads,
               "seconds": round(time.perf_counter() - began, 1), "log": log}
    (args.out / "training_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train the demo model (both towers) on the shapes grammar")
    parser.add_argument("--out", type=Path, default=Path("demo/checkpoints/dense"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=13000)
    parser.add_argument("--token-budget", type=int, default=384, help="image tokens per batch")
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--ema", type=float, default=0.999)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size-power", type=float, default=SIZE_POWER,
                        help="sizes drawn with probability ~ tokens ** -power (0: the same compute per size)")
    parser.add_argument("--side-range", type=float, nargs=2, default=LAYOUT.side_range, metavar=("LOW", "HIGH"),
                        help="the shape's side, as fractions of the shorter image side")
    parser.add_argument("--jitter", type=float, default=LAYOUT.jitter,
                        help="the shape centre's jitter, as a fraction of the image side along each axis")
    parser.add_argument("--noise-scale-mode", choices=("resolution", "constant"), default=NOISE["noise_scale_mode"],
                        help="the starting noise's loudness: growing with the image's tokens, or the same at "
                        "every size (written to the checkpoint's config; the sampler follows it)")
    parser.add_argument("--head", choices=("pixel", "mlp"), default="pixel",
                        help="the checkpoint's head: the pixel head (convs across tokens) or the per-token MLP head")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--init", type=Path, help="start from this demo checkpoint's weights, not the seed's")
    parser.add_argument("--weight-floor", type=float, help="train on the x-prediction error weighted by "
                        "1/max(1-t, floor)^2 (default: the velocity loss)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (the card's run) or cuda (same data, other rounding; no faster for this tower)")
    train(parser.parse_args(argv))


if __name__ == "__main__":
    main()
