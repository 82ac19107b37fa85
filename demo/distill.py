"""The demo's 8-step LoRA: distilled from the 50-step CFG teacher for 8 steps without CFG.

Method (trajectory matching): the teacher (the dense demo model, CFG 4, global norm) is run
from fresh noise along the student's 8-step shifted time grid, each student interval split
into ``SUBSTEPS`` Euler steps (48 teacher steps in all), and its state is kept at every
student time. The student (teacher weights + a rank-``RANK`` LoRA on every decoder linear of
the generation tower) then learns, from the teacher's state at student time ``t_k`` and the
prompt alone, the x-prediction whose one Euler step lands on the teacher's state at ``t_k+1``.
"""

from __future__ import annotations

import json
import time

import torch
from safetensors.torch import save_file

from demo.model import GenerationBatch, load_demo, target_tokens, towers
from demo.training import Batches, Schedule, fit, prompt_ids, run_parser, start_run
from neopp.model.checkpoint import layer_prefix
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.model.embeddings import unpatchify
from neopp.sampling.schedule import initial_noise_scale, shifted_timesteps

STUDENT_STEPS, SUBSTEPS, SHIFT, CFG_SCALE = 8, 6, 3.0, 4.0
RANK, ALPHA = 8, 8.0
SIZES = [(128, 128), (128, 192), (192, 128), (192, 192), (128, 256), (256, 128), (256, 256)]
LORA_FILE = "neopp_8steps_lora.safetensors"


def lora_targets(layers: int) -> list[str]:
    out = []
    for i in range(layers):
        a, m = layer_prefix(i) + "self_attn.", layer_prefix(i) + "mlp_mot_gen."
        out += [f"{a}{n}_mot_gen.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        out += [f"{m}{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    return out


class Teacher:
    """The dense model sampling with CFG along the student's grid, substeps in between."""

    def __init__(self, config: CheckpointConfig, language, tower: GenerationBatch) -> None:
        self.config, self.language, self.tower = config, language, tower
        grid = shifted_timesteps(STUDENT_STEPS, SHIFT)
        self.grid = grid
        self.fine = [grid[k] + (grid[k + 1] - grid[k]) * j / SUBSTEPS
                     for k in range(STUDENT_STEPS) for j in range(SUBSTEPS)] + [grid[-1]]

    @torch.no_grad()
    def trajectory(self, ids: torch.Tensor, lengths: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """States [STUDENT_STEPS + 1, B, 3, H, W] at the student's times, from ``noise`` (scaled)."""
        n = noise.shape[0]
        h, w = noise.shape[2:]
        tokens = (h // 32) * (w // 32)
        scale = initial_noise_scale(self.config, tokens)
        empty = torch.ones_like(ids[:, :1])                       # <bos> alone, the unconditional prompt
        cond, uncond = self.language.prefix_kv(ids), self.language.prefix_kv(empty)
        pad = cond.shape[3] - 1
        uncond = torch.cat([uncond, uncond.new_zeros(*uncond.shape[:3], pad, *uncond.shape[4:])], dim=3)
        prefix, lens = torch.cat([cond, uncond]), torch.cat([lengths, torch.ones_like(lengths)])
        x, states = noise.clone(), [noise.clone()]
        for i in range(len(self.fine) - 1):
            t0, t1 = self.fine[i], self.fine[i + 1]
            z = target_tokens(x)
            pred = self.tower.predict(torch.cat([x, x]), torch.full((2 * n,), t0), scale, prefix, lens)
            v = (pred - torch.cat([z, z])) / max(1 - t0, 0.02)
            vc, vu = v[:n], v[n:]
            guided = vu + CFG_SCALE * (vc - vu)
            ratio = (vc.flatten(1).norm(dim=1) / (guided.flatten(1).norm(dim=1) + 1e-8)).clamp(0, 1)
            z = z + (t1 - t0) * guided * ratio[:, None, None]
            x = torch.cat([unpatchify(zi, h, w, 32) for zi in z])
            if (i + 1) % SUBSTEPS == 0:
                states.append(x.clone())
        return torch.stack(states)


def main(argv: list[str] | None = None) -> None:
    parser = run_parser(__doc__, "demo/checkpoints/lora", seed=2, steps=1200, lr=1e-3)
    parser.add_argument("--trajectories", type=int, default=480)
    args = parser.parse_args(argv)
    start_run(args)
    config, tokenizer, base = load_demo(args.dense)
    language, tower = towers(config, base, tokenizer)
    teacher = Teacher(config, language, tower)
    batches = Batches(args.seed, args.token_budget, SIZES)
    began, data, made = time.perf_counter(), [], 0
    while made < args.trajectories:
        scenes, x0 = batches.images()
        ids, lengths = prompt_ids([s.prompt for s in scenes], tokenizer)
        scale = initial_noise_scale(config, (x0.shape[2] // 32) * (x0.shape[3] // 32))
        noise = torch.randn(x0.shape, generator=batches.gen) * scale
        data.append((ids, lengths, teacher.trajectory(ids, lengths, noise), scale))
        made += x0.shape[0]
    teacher_s = time.perf_counter() - began
    print(json.dumps({"trajectories": made, "teacher_seconds": round(teacher_s, 1)}), flush=True)

    g = torch.Generator().manual_seed(args.seed)
    targets = lora_targets(config.num_layers)
    lora = {}
    for key in targets:
        out_f, in_f = base[key].shape
        lora[key + "A"] = (torch.randn(RANK, in_f, generator=g) / in_f ** 0.5).requires_grad_(True)
        lora[key + "B"] = torch.zeros(out_f, RANK).requires_grad_(True)
    grid = teacher.grid

    def loss() -> torch.Tensor:
        ids, lengths, states, scale = data[int(torch.randint(len(data), (1,), generator=g))]
        n = ids.shape[0]
        k = torch.randint(STUDENT_STEPS, (n,), generator=g)
        rows = torch.arange(n)
        x, x_next = states[k, rows], states[k + 1, rows]
        t0, t1 = torch.tensor(grid)[k], torch.tensor(grid)[k + 1]
        weights = dict(base)
        for key in targets:
            weights[key] = base[key] + (ALPHA / RANK) * lora[key + "B"] @ lora[key + "A"]
        _, student = towers(config, weights, tokenizer)
        with torch.no_grad():
            prefix = language.prefix_kv(ids)
        pred = student.predict(x, t0.float(), scale, prefix, lengths)
        z, z_next = target_tokens(x), target_tokens(x_next)
        gap = (1 - t0).clamp(min=0.02)[:, None, None]
        wanted = z + (z_next - z) * gap / (t1 - t0)[:, None, None]
        return (pred - wanted).square().mean()

    ema, log = fit(lora, loss, Schedule(args.steps, args.lr, warmup=50))
    args.out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key in targets:
        stem = key[: -len(".weight")]
        tensors[stem + ".lora_A.weight"] = ema[key + "A"].contiguous()
        tensors[stem + ".lora_B.weight"] = ema[key + "B"].contiguous()
        tensors[stem + ".alpha"] = torch.tensor(ALPHA)
    save_file(tensors, str(args.out / LORA_FILE))
    summary = {"teacher": f"{args.dense}, 50-step grid equivalent: {STUDENT_STEPS}x{SUBSTEPS} Euler steps, "
                          f"CFG {CFG_SCALE} global norm", "rank": RANK, "alpha": ALPHA, "seed": args.seed,
               "trajectories": made, "teacher_seconds": round(teacher_s, 1), "steps": args.steps, "lr": args.lr,
               "seconds": round(time.perf_counter() - began, 1), "log": log}
    (args.out / "training_log.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
