"""What the demo's three training runs share: batches of the shapes task, the flow-matching
loss as the sampler sees it, and one optimisation loop (AdamW, warm-up + cosine, EMA, a log)."""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from demo import shapes
from demo.model import GenerationBatch, target_tokens
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.model.layers import row_tiles
from neopp.sampling.schedule import initial_noise_scale
from neopp.text.language_tower import LanguageTower
from neopp.text.tokenizer import PAD, WordTokenizer

SHIFT = 3.0            # the sampler's timestep_shift (configs/neopp/neopp_dense.json)
# 1 - t floor in the velocity's divisor: keeps the nearly clean times from dominating the loss. Above
# t = 1 - floor it also moves the loss's optimum off x0 (to x_t + floor (x0 - n)), so it stays small:
# the 50-step grid's last time before 1 is 0.942.
LOSS_MIN_GAP = 0.05
DROP_PROMPT = 0.1
# Sizes drawn with probability ~ tokens ** -SIZE_POWER at a fixed token budget per batch. At 1,
# 128x128 images outnumbered 256x256 ones 16 to 1 and the model drew 128-px-sized shapes on every
# canvas; at 0 every size gets the same compute.
SIZE_POWER = 0.0


@dataclass(frozen=True)
class Schedule:
    steps: int
    lr: float
    warmup: int = 200
    ema: float = 0.999
    log_every: int = 50

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Batches:
    """Seeded batches: an image size, rendered scenes, their prompts.

    A size is drawn with probability proportional to ``tokens ** -size_power``; every batch holds
    about ``token_budget`` tokens, so power 0 spends the same compute on every size."""

    def __init__(self, seed: int, token_budget: int, sizes: list[tuple[int, int]] | None = None,
                 size_power: float = SIZE_POWER, layout: shapes.Layout = shapes.LAYOUT) -> None:
        self.rng = np.random.default_rng(seed)
        self.layout = layout
        self.gen = torch.Generator().manual_seed(seed)
        self.token_budget = token_budget
        self.last_tokens = 0  # image tokens of the latest batch (what throughput counts)
        self.sizes = sizes or list(shapes.SIZES)
        w = np.array([((h // 32) * (w // 32)) ** -size_power for h, w in self.sizes])
        self.probs = w / w.sum()

    def size(self) -> tuple[int, int, int]:
        """(height, width, images in the batch)."""
        h, w = self.sizes[self.rng.choice(len(self.sizes), p=self.probs)]
        return h, w, max(2, self.token_budget // ((h // 32) * (w // 32)))

    def images(self) -> tuple[list, torch.Tensor]:
        h, w, n = self.size()
        self.last_tokens = n * (h // 32) * (w // 32)
        scenes, images = shapes.sample_batch(self.rng, n, h, w, layout=self.layout)
        return scenes, torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0

    def times(self, n: int) -> torch.Tensor:
        """Uniform times warped by the sampler's shift: the steps' own distribution."""
        sigma = 1.0 - torch.rand(n, generator=self.gen)
        return 1.0 - SHIFT * sigma / (1.0 + (SHIFT - 1.0) * sigma)


def vocabulary() -> list[str]:
    return sorted({w for s in shapes.all_scenes() for w in s.prompt.split()})


def prompt_ids(prompts: list[str], tokenizer: WordTokenizer, drop: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, S] right-padded and each row's length; a dropped row is ``<bos>`` alone."""
    rows = [tokenizer.encode(p, known_only=False) for p in prompts]  # a test's small vocabulary: <unk>
    if drop is not None:
        rows = [r[:1] if d else r for r, d in zip(rows, drop.tolist())]
    width = max(len(r) for r in rows)
    pad = tokenizer.ids[PAD]
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows]), torch.tensor([len(r) for r in rows])


def flow_matching_loss(batches: Batches, config: CheckpointConfig, language: LanguageTower,
                       tower: GenerationBatch, tokenizer: WordTokenizer, weight_floor: float | None = None
                       ) -> torch.Tensor:
    """Velocity error of the x-prediction at one random time per image.

    With ``weight_floor`` it is the x-prediction's error weighted by ``1 / max(1 - t, floor)^2``
    instead: the velocity error wherever ``1 - t`` is above the floor, and a capped weight, with the
    optimum still at x0, below it (the demo's experiments with more weight on noisy times)."""
    scenes, x0 = batches.images()
    n, dev = x0.shape[0], language.embed.device
    drop = torch.rand(n, generator=batches.gen) < DROP_PROMPT
    ids, lengths = prompt_ids([s.prompt for s in scenes], tokenizer, drop)
    scale = initial_noise_scale(config, (x0.shape[2] // 32) * (x0.shape[3] // 32))
    t = batches.times(n)
    noise = torch.randn(x0.shape, generator=batches.gen) * scale  # drawn on the CPU: any device, same data
    x0, t, noise, ids, lengths = (v.to(dev) for v in (x0, t, noise, ids, lengths))
    tb = t[:, None, None, None]
    xt = tb * x0 + (1 - tb) * noise
    pred = tower.predict(xt, t, scale, language.prefix_kv(ids), lengths)
    if weight_floor is not None:
        weight = (1 - t).clamp(min=weight_floor)[:, None, None] ** -2
        return ((pred - target_tokens(x0)).square() * weight).mean()
    gap = (1 - t).clamp(min=LOSS_MIN_GAP)[:, None, None]
    return ((pred - target_tokens(xt)) / gap - (target_tokens(x0) - target_tokens(noise))).square().mean()


def optimizer(params: dict[str, torch.Tensor], lr: float, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW as the demo's runs use it (the fused kernel rounds differently: not the card's runs)."""
    return torch.optim.AdamW(params.values(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0, fused=fused or None)


def train_step(params: dict[str, torch.Tensor], ema: dict[str, torch.Tensor], opt: torch.optim.Optimizer,
               loss_fn: Callable[[], torch.Tensor], lr: float, decay: float) -> float:
    """One update: loss, clipped gradient, AdamW at ``lr``, EMA with ``decay``; returns the loss."""
    loss = loss_fn()
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
    opt.step()
    with torch.no_grad():
        for k, v in params.items():
            ema[k].mul_(decay).add_(v.detach(), alpha=1 - decay)
    return loss.item()


def fit(params: dict[str, torch.Tensor], loss_fn: Callable[[], torch.Tensor], schedule: Schedule
        ) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Optimise ``params`` (tensors that require grad) on ``loss_fn``; returns their EMA and the log.

    Products run whole, not in the serving's fixed row tiles: training needs no batch invariance."""
    ema = {k: v.detach().clone() for k, v in params.items()}
    opt = optimizer(params, schedule.lr)
    log, window, began = [], [], time.perf_counter()
    with row_tiles(0):
        for step in range(schedule.steps):
            decay = min(schedule.ema, (1 + step) / (10 + step))
            window.append(train_step(params, ema, opt, loss_fn, schedule.lr_at(step), decay))
            if (step + 1) % schedule.log_every == 0:
                log.append({"step": step + 1, "loss": float(np.mean(window)),
                            "seconds": round(time.perf_counter() - began, 1)})
                window = []
                print(json.dumps(log[-1]), flush=True)
    return ema, log


def run_parser(doc: str | None, out: str, seed: int, steps: int, lr: float) -> argparse.ArgumentParser:
    """The flags of a run that starts from the trained dense demo (upcycling, distillation)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dense", type=Path, default=Path("demo/checkpoints/dense"))
    parser.add_argument("--out", type=Path, default=Path(out))
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--token-budget", type=int, default=384)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--threads", type=int, default=2)
    return parser


def start_run(args: argparse.Namespace) -> dict:
    """Seeds and threads set; the dense demo's config.json."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    return json.loads((args.dense / "config.json").read_text())
