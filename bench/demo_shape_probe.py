"""Where the demo model decides the shape: from the prompt, or from the noise.

Two measurements on held-out prompts at 256x256, with `neopp_dense`'s sampling (50 shifted
steps, CFG 4, global norm):

1. **Start later.** Each prompt's own rendering, noised to a time ``t0`` of the step grid, is
   denoised from there. From ``t0`` = 0 (pure noise) this is plain generation; the later the
   start, the more of the true shape the image already holds.
2. **Same noise, three shape words.** One noise, the prompt with each shape word: how often the
   three images get the same judged shape, and the mean fill ratio per word.
3. **The first prediction.** At ``t`` = 0 the input is pure noise, so the best x-prediction is
   the prompt's mean image, the same for every noise. How much the prediction moves between two
   noises against between two shape words, and how much a wrong shape word raises its error.
4. **The prefix.** How far apart the keys and values at the shape word's place are for the
   three shape words, beside the same for three colour words (a colour the tower does draw).

It runs the training forward (`demo.model.GenerationBatch`, checked against the served tower
by the tests) because serving cannot start mid-way.

    python -m bench.demo_shape_probe --n 48    # bench/demo_shape_probe.md
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from bench.common import REPO, write_report
from demo import shapes
from demo.model import load_demo, target_tokens, towers
from demo.training import prompt_ids
from neopp.model.embeddings import unpatchify
from neopp.modes import load_mode
from neopp.sampling.guidance import COND, UNCOND, combine
from neopp.sampling.schedule import initial_noise_scale, shifted_timesteps

SIZE = 256
SAMPLING = load_mode(REPO / "configs" / "neopp" / "neopp_dense.json").sampling_params


class Sampler:
    """Euler steps of the x-prediction with guidance, batched over images, from any grid time."""

    def __init__(self, ckpt: Path) -> None:
        self.config, self.tokenizer, params = load_demo(ckpt)
        self.language, self.tower = towers(self.config, params, self.tokenizer)
        self.times = shifted_timesteps(SAMPLING.infer_steps, SAMPLING.timestep_shift)
        self.scale = initial_noise_scale(self.config, (SIZE // 32) ** 2)

    def noise(self, n: int, seed: int) -> torch.Tensor:
        return torch.randn((n, 3, SIZE, SIZE), generator=torch.Generator().manual_seed(seed)) * self.scale

    @torch.no_grad()
    def run(self, prompts: list[str], x: torch.Tensor, start: int) -> np.ndarray:
        """Images uint8 [B, H, W, 3] from state ``x`` at grid time ``start``."""
        lang, tower = self.language, self.tower
        cond = prompt_ids(prompts, self.tokenizer)
        uncond = prompt_ids([""] * len(prompts), self.tokenizer)
        kv = {COND: (lang.prefix_kv(cond[0]), cond[1]), UNCOND: (lang.prefix_kv(uncond[0]), uncond[1])}
        for k in range(start, SAMPLING.infer_steps):
            t, t_next = self.times[k], self.times[k + 1]
            z = target_tokens(x)
            v = {name: (tower.predict(x, torch.full((len(prompts),), t), self.scale, p, n) - z) / (1 - t)
                 for name, (p, n) in kv.items()}
            step = torch.stack([combine({COND: v[COND][i], UNCOND: v[UNCOND][i]}, SAMPLING)
                                for i in range(len(prompts))])
            x = torch.cat([unpatchify(r, SIZE, SIZE, 32) for r in z + (t_next - t) * step])
        return ((x.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()


def fills(images: np.ndarray, scenes: list[shapes.Scene]) -> dict[str, str]:
    """Mean bounding-box fill of the drawn shape, per prompted shape word."""
    out = {}
    for word in shapes.SHAPES:
        got = [shapes.judge(im, s).fill_ratio for im, s in zip(images, scenes) if s.shape == word]
        got = [f for f in got if f is not None]
        out[word] = f"{np.mean(got):.2f}" if got else "-"
    return out


def renderings(scenes: list[shapes.Scene]) -> torch.Tensor:
    """Each prompt's own image in [-1, 1], [B, 3, H, W]; one fixed draw of sizes and jitter."""
    rng = np.random.default_rng(0)
    x0 = torch.from_numpy(np.stack([shapes.render(s, SIZE, SIZE, rng) for s in scenes]))
    return x0.permute(0, 3, 1, 2).float() / 127.5 - 1.0


def start_later(sampler: Sampler, scenes: list[shapes.Scene], starts: list[float]) -> str:
    x0 = renderings(scenes)
    noise = sampler.noise(len(scenes), 0)
    lines = ["| start t0 | shape right | colour right | position right | fill: circle / square / triangle |",
             "|---|---|---|---|---|"]
    for t0 in starts:
        k = min(range(SAMPLING.infer_steps), key=lambda i: abs(sampler.times[i] - t0))
        t = sampler.times[k]
        images = sampler.run([s.prompt for s in scenes], t * x0 + (1 - t) * noise, k)
        s, f = shapes.score(images, scenes), fills(images, scenes)
        lines.append(f"| {t:.2f} (step {k}) | {100 * s['shape']:.1f} % | {100 * s['color']:.1f} % | "
                     f"{100 * s['position']:.1f} % | {f['circle']} / {f['square']} / {f['triangle']} |")
    return "\n".join(lines)


def three_words(sampler: Sampler, scenes: list[shapes.Scene]) -> str:
    same, drawn, asked = 0, [], []
    for i, scene in enumerate(scenes):
        variants = [shapes.Scene(w, scene.color, scene.position, scene.background) for w in shapes.SHAPES]
        images = sampler.run([v.prompt for v in variants], sampler.noise(1, 1000 + i).repeat(3, 1, 1, 1), 0)
        same += len({shapes.judge(im, v).shape for im, v in zip(images, variants)}) == 1
        drawn.extend(images)
        asked.extend(variants)
    means = " / ".join(fills(np.stack(drawn), asked).values())
    return (f"{same} of {len(scenes)} noises give the same judged shape for all three words "
            f"(mean fill for circle / square / triangle: {means}; rendered: about 0.81 / 1.00 / 0.60).")


def first_prediction(sampler: Sampler, scenes: list[shapes.Scene]) -> str:
    n, t0 = len(scenes), torch.zeros(len(scenes))
    preds = {}
    with torch.no_grad():
        for word in shapes.SHAPES:
            ids, lengths = prompt_ids([replace(s, shape=word).prompt for s in scenes], sampler.tokenizer)
            prefix = sampler.language.prefix_kv(ids)
            for j in (0, 1):
                preds[word, j] = sampler.tower.predict(sampler.noise(n, 2000 + j), t0, sampler.scale, prefix, lengths)
    pairs = [(a, b) for a in shapes.SHAPES for b in shapes.SHAPES if a < b]
    by_noise = np.mean([(preds[w, 0] - preds[w, 1]).square().mean().item() for w in shapes.SHAPES])
    by_word = np.mean([(preds[a, 0] - preds[b, 0]).square().mean().item() for a, b in pairs])
    target = target_tokens(renderings(scenes))
    err = {w: (preds[w, 0] - target).square().mean(dim=(1, 2)) for w in shapes.SHAPES}
    right = torch.stack([err[s.shape][i] for i, s in enumerate(scenes)]).mean().item()
    wrong = torch.stack([err[w][i] for i, s in enumerate(scenes) for w in shapes.SHAPES if w != s.shape]).mean().item()
    return (f"Mean squared change of the prediction at t = 0: {by_noise:.4f} between two noises, "
            f"{by_word:.4f} between two shape words (ratio {by_noise / by_word:.1f}). Its error against "
            f"the prompt's rendering: {right:.4f} with the prompt's shape word, {wrong:.4f} with another "
            f"(+{100 * (wrong / right - 1):.0f} %).")


def prefix_spread(sampler: Sampler, scenes: list[shapes.Scene]) -> str:
    """Mean pairwise distance of the word's keys and values, relative to their norm, per layer."""
    def spread(variants: list[shapes.Scene]) -> torch.Tensor:
        ids = prompt_ids([v.prompt for v in variants], sampler.tokenizer)[0]
        place = int((ids != ids[0]).any(0).nonzero()[0])                   # the one word that differs
        with torch.no_grad():
            x = sampler.language.prefix_kv(ids)[:, :, :, place].flatten(3)  # [3, NL, 2, NKV*HD]
        gaps = [(x[a] - x[b]).norm(dim=-1) for a in range(3) for b in range(a + 1, 3)]
        return torch.stack(gaps).mean(0) / x.norm(dim=-1).mean(0)          # [NL, 2]

    by_shape = torch.stack([spread([replace(s, shape=w) for w in shapes.SHAPES]) for s in scenes]).mean(0)
    colours = [[c for c in shapes.COLORS if c != s.background][:3] for s in scenes]
    by_colour = torch.stack([spread([replace(s, color=c) for c in cs]) for s, cs in zip(scenes, colours)]).mean(0)
    lines = ["| layer | shape words: keys | values | colour words: keys | values |", "|---|---|---|---|---|"]
    lines += [f"| {i} | {by_shape[i, 0]:.2f} | {by_shape[i, 1]:.2f} | {by_colour[i, 0]:.2f} | {by_colour[i, 1]:.2f} |"
              for i in range(by_shape.shape[0])]
    return ("Distance between the keys (and values) at the word's place for two words, over their norm, "
            "mean over word pairs and prompts:\n\n" + "\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=REPO / "demo" / "checkpoints" / "dense")
    parser.add_argument("--n", type=int, default=48, help="held-out prompts")
    parser.add_argument("--starts", default="0,0.3,0.5,0.7", help="start times t0, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "demo_shape_probe.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sampler = Sampler(args.checkpoint)
    scenes = shapes.held_out_scenes()[: args.n]
    body = (f"{args.n} held-out prompts, {SIZE}x{SIZE}, `neopp_dense`'s sampling, checkpoint "
            f"`{args.checkpoint.relative_to(REPO) if args.checkpoint.is_relative_to(REPO) else args.checkpoint.name}`."
            f"\n\n## Start later\n\n{start_later(sampler, scenes, [float(s) for s in args.starts.split(',')])}"
            f"\n\n## Same noise, three shape words\n\n{three_words(sampler, scenes[: args.n // 2])}"
            f"\n\n## The first prediction\n\n{first_prediction(sampler, scenes)}"
            f"\n\n## The prefix\n\n{prefix_spread(sampler, scenes)}")
    write_report(args.out, "Where the demo model decides the shape", body)


if __name__ == "__main__":
    main()
