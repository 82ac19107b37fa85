"""The demo model's training code against the runtime that serves its weights.

Training runs the generation tower batched (``GenerationBatch``); serving runs it per request
(``NeoPPTransformer`` with a ``BranchContext``). Both must compute the same prediction, or the
served model would not be the trained one. Upcycling and the LoRA file are checked through the
runtime's own loaders.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from demo.distill import ALPHA, RANK, lora_targets
from demo.model import load_demo, save_checkpoint, towers
from demo.training import LOSS_MIN_GAP, Batches, flow_matching_loss
from demo.upcycle import EXPERTS, TOP_K, upcycled
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.model.lora import apply_loras_
from neopp.model.transformer import BranchContext
from neopp.modes import ModeSpec, load_mode
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.schedule import shifted_timesteps
from neopp.text.language_tower import LanguageTower, is_language_key
from neopp.text.tokenizer import WordTokenizer
from testing import REPO
from testing.demo_checkpoint import write_demo_checkpoint

PROMPTS = ["a red circle on the left on a blue background", ""]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "dense", seed=3)


def moe_checkpoint(dense, out, perturb: float):
    cfg = json.loads((dense / "config.json").read_text())
    cfg["llm_config"].update(gen_num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True)
    tensors = upcycled(load_file(str(dense / "model.safetensors")), cfg["llm_config"]["num_hidden_layers"], 0, perturb)
    return save_checkpoint(out, cfg, WordTokenizer.from_file(dense / "tokenizer.json"), tensors, torch.float32)


def served_predictions(ckpt, x, t, scale):
    """The runtime's per-request prediction for each prompt (its own prefix and offset)."""
    version = "moe" if CheckpointConfig.from_checkpoint(ckpt).is_moe else "dense"
    pipe = NeoPPPipeline.from_pretrained(ckpt, ModeSpec(version=version), "cpu", torch.float32)
    language = LanguageTower.from_pretrained(ckpt)
    grid = pipe.grid(x.shape[2], x.shape[3])
    out = []
    with torch.no_grad():
        for b, prompt in enumerate(PROMPTS):
            kv, offset = language.conditional(prompt)
            branch = BranchContext(kv, offset, grid, pipe.config, pipe.device, torch.float32)
            hid = pipe.transformer.run_layers(pipe.transformer.embed(x[b:b + 1], float(t[b]), scale, grid), branch)
            out.append(pipe.transformer.predict(hid, grid))
    return torch.stack(out)


def trained_predictions(ckpt, x, t, scale):
    config = CheckpointConfig.from_checkpoint(ckpt)
    tokenizer = WordTokenizer.from_file(ckpt / "tokenizer.json")
    params = {k: v.float() for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    language, tower = towers(config, params, tokenizer)
    rows = [tokenizer.encode(p, known_only=False) for p in PROMPTS]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        return tower.predict(x, t, scale, language.prefix_kv(ids), torch.tensor([len(r) for r in rows]))


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_the_training_forward_is_the_served_forward(dense, tmp_path, variant):
    ckpt = dense if variant == "dense" else moe_checkpoint(dense, tmp_path / "moe", 0.05)
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 3, 96, 128, generator=g), torch.tensor([0.2, 0.8])
    served, trained = served_predictions(ckpt, x, t, 1.3), trained_predictions(ckpt, x, t, 1.3)
    scale = served.abs().max().item()
    assert (served - trained).abs().max().item() <= 1e-5 * scale  # float32, batched vs one by one


def test_unperturbed_upcycling_keeps_the_dense_model(dense, tmp_path):
    """Identical experts whose routing weights sum to one are the dense MLP."""
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(2, 3, 64, 64, generator=g), torch.tensor([0.5, 0.5])
    moe = moe_checkpoint(dense, tmp_path / "moe0", 0.0)
    a, b = served_predictions(dense, x, t, 1.0), served_predictions(moe, x, t, 1.0)
    assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()


def test_the_loss_trains_both_towers(dense):
    config = CheckpointConfig.from_checkpoint(dense)
    tokenizer = WordTokenizer.from_file(dense / "tokenizer.json")
    params = {k: v.float().requires_grad_(True) for k, v in load_file(str(dense / "model.safetensors")).items()}
    language, tower = towers(config, params, tokenizer)
    loss = flow_matching_loss(Batches(0, 64), config, language, tower, tokenizer)
    loss.backward()
    assert torch.isfinite(loss)
    for key in ("language_model.model.embed_tokens.weight", "language_model.model.layers.0.self_attn.k_proj.weight",
                "language_model.model.layers.0.self_attn.q_proj_mot_gen.weight", "fm_modules.fm_head.conv2.weight"):
        assert params[key].grad is not None and params[key].grad.abs().sum() > 0, key


def test_the_weighted_x_loss_is_the_velocity_loss_away_from_the_floor(dense):
    """(x0_hat - x_t)/(1 - t) - (x0 - n) = (x0_hat - x0)/(1 - t): the two forms agree wherever
    1 - t is above both floors, on the very same batch (same seed, same draws)."""
    config, tokenizer, params = load_demo(dense)
    language, tower = towers(config, params, tokenizer)
    probe = Batches(3, 64)
    n = len(probe.images()[0])
    torch.rand(n, generator=probe.gen)  # the prompt dropout's draw, then the loss's times
    assert probe.times(n).max().item() < 1 - LOSS_MIN_GAP  # this seed draws no time past the floor
    with torch.no_grad():
        velocity = flow_matching_loss(Batches(3, 64), config, language, tower, tokenizer)
        weighted = flow_matching_loss(Batches(3, 64), config, language, tower, tokenizer, LOSS_MIN_GAP)
        capped = flow_matching_loss(Batches(3, 64), config, language, tower, tokenizer, 1.0)
    assert abs(weighted.item() - velocity.item()) <= 1e-4 * velocity.item()
    assert capped.item() < weighted.item()  # every weight 1 instead of 1/(1 - t)^2 >= 1


def test_training_draws_its_times_as_the_sampler_spaces_its_steps():
    """The loss's times and `neopp_dense`'s step grid come from one shift: a share k/50 of the
    training times falls below the grid's k-th time (the training spends its steps where the
    served sampler does)."""
    sampling = load_mode(REPO / "configs" / "neopp" / "neopp_dense.json").sampling_params
    grid = shifted_timesteps(sampling.infer_steps, sampling.timestep_shift)
    times = Batches(0, 64).times(40000)
    for k in (5, 10, 25, 40, 49):
        assert abs((times < grid[k]).float().mean().item() - k / sampling.infer_steps) < 0.01, k


def test_the_distilled_lora_file_is_what_the_runtime_merges(dense, tmp_path):
    base = {k: v.float() for k, v in load_file(str(dense / "model.safetensors")).items()}
    targets = lora_targets(CheckpointConfig.from_checkpoint(dense).num_layers)
    g = torch.Generator().manual_seed(2)
    tensors, deltas = {}, {}
    for key in targets:
        out_f, in_f = base[key].shape
        a, b = torch.randn(RANK, in_f, generator=g), torch.randn(out_f, RANK, generator=g)
        stem = key[: -len(".weight")]
        tensors.update({stem + ".lora_A.weight": a, stem + ".lora_B.weight": b, stem + ".alpha": torch.tensor(ALPHA)})
        deltas[key] = (ALPHA / RANK) * b @ a
    save_file(tensors, str(tmp_path / "l.safetensors"))
    merged = dict(base)
    apply_loras_(merged, [{"path": str(tmp_path / "l.safetensors"), "strength": 1.0}])
    for key in targets:
        torch.testing.assert_close(merged[key], base[key] + deltas[key], rtol=1e-5, atol=1e-5)


def test_the_committed_demo_weights_load_through_the_real_loaders():
    demo = REPO / "demo" / "checkpoints"
    assert all(f.stat().st_size <= 30 * 2**20 for f in demo.rglob("*.safetensors"))
    modes = {"dense": ModeSpec(), "moe": ModeSpec(version="moe"),
             "lora": load_mode(REPO / "configs" / "neopp" / "neopp_dense_8steps.json", lora_dir=demo / "lora")}
    for name, mode in modes.items():
        NeoPPPipeline.from_pretrained(demo / ("dense" if name == "lora" else name), mode, "cpu", torch.float32)
    dense, moe = (load_file(str(demo / n / "model.safetensors")) for n in ("dense", "moe"))
    language = [k for k in dense if is_language_key(k)]
    assert language and all(torch.equal(dense[k], moe[k]) for k in language)  # one prompt encoder serves both
