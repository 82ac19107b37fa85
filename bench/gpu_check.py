"""GPU check: one 1024x1024 image with 50 CFG steps on the real 8B dense shapes.

    python -m bench.gpu_check [--steps 50] [--size 1024] [--layers 36]

Builds a random tower with SenseNova-U1 8B's generation geometry (36 layers, hidden 4096,
32 heads, 8 KV heads, head dim 128) directly on the GPU in bf16 (no checkpoint file),
generates one image, and prints seconds per image and per step, peak GPU memory, and the
card's plain bf16 matmul TFLOP/s measured in the same run. Meant to finish within 8 minutes
on one H200.
"""

from __future__ import annotations

import argparse
import time

import torch

from neopp.checkpoint import FM, expected_shapes, layer_prefix
from neopp.checkpoint_config import CheckpointConfig
from neopp.modes import ModeSpec, SamplingParams
from neopp.pipeline import GenerationRequest, NeoPPPipeline
from neopp.rng import NoiseStream
from neopp.transformer import NeoPPTransformer

REAL_8B = {"num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "rope_theta": 5_000_000.0, "rope_theta_hw": 10_000.0}
MLP_WIDTH, HEAD_WIDTH, VISION_WIDTH = 12288, 4096, 1024


def random_tower_tensors(cfg: CheckpointConfig, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every key of the real layout, drawn on the device: N(0, 1/fan_in) weights, unit norms."""
    widths = {FM + "fm_head.0.weight": torch.empty(HEAD_WIDTH, cfg.hidden_size, device="meta")}
    for i in range(cfg.num_layers):
        widths[layer_prefix(i) + "mlp_mot_gen.gate_proj.weight"] = torch.empty(MLP_WIDTH, cfg.hidden_size,
                                                                                device="meta")
    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    for key, shape in expected_shapes(cfg, widths).items():
        if len(shape) == 1:
            out[key] = (torch.ones(shape, device=device, dtype=dtype) if key.endswith("norm_mot_gen.weight")
                        or "layernorm" in key or "_norm" in key else torch.zeros(shape, device=device, dtype=dtype))
        else:
            fan_in = int(torch.tensor(shape[1:]).prod())
            out[key] = (torch.randn(shape, generator=gen, device=device, dtype=dtype) / fan_in ** 0.5)
    return out


def matmul_tflops(device: torch.device, n: int = 8192, repeats: int = 20) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * repeats / (time.perf_counter() - start) / 1e12


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--prefix", type=int, default=300)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA device")
    device, dtype = torch.device("cuda"), torch.bfloat16
    raw = {"llm_config": {**REAL_8B, "num_hidden_layers": args.layers},
           "vision_config": {"hidden_size": VISION_WIDTH, "rope_theta_vision": 10_000.0,
                             "max_position_embeddings_vision": 1024}}
    cfg = CheckpointConfig.from_dict(raw)
    t0 = time.perf_counter()
    tower = NeoPPTransformer.from_tensors(cfg, random_tower_tensors(cfg, device, dtype), device, dtype)
    pipe = NeoPPPipeline(cfg, tower, ModeSpec(), device, dtype)
    build_s = time.perf_counter() - t0
    weights_gib = torch.cuda.memory_allocated() / 2 ** 30
    kv_shape = (cfg.num_layers, 2, args.prefix, cfg.num_kv_heads, cfg.head_dim)
    gen = torch.Generator(device=device).manual_seed(1)
    cond = torch.randn(kv_shape, generator=gen, device=device, dtype=dtype)
    uncond = torch.randn((cfg.num_layers, 2, 12, cfg.num_kv_heads, cfg.head_dim), generator=gen, device=device,
                         dtype=dtype)
    sampling = SamplingParams(infer_steps=args.steps)
    req = GenerationRequest(cond_kv=cond, uncond_kv=uncond, index_offset_cond=args.prefix, index_offset_uncond=12,
                            height=args.size, width=args.size, noise=NoiseStream(200).draw(args.size, args.size),
                            sampling=sampling)
    pipe.validate(req)
    warm = GenerationRequest(**{**req.__dict__, "sampling": SamplingParams(infer_steps=2)})
    pipe.generate(warm)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    steps: list[float] = []
    start = time.perf_counter()
    pixels = pipe.generate(req, on_step=lambda k, s: steps.append(s))
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    tflops = matmul_tflops(device)
    steps.sort()
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    print(f"geometry: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads, "
          f"{cfg.num_kv_heads} kv heads, head dim {cfg.head_dim}, mlp {MLP_WIDTH}; build {build_s:.1f} s")
    print(f"image {args.size}x{args.size}, {args.steps} steps, CFG (batched: {pipe.batch_cfg((args.size // 32) ** 2)}), "
          f"prefix {args.prefix}: {total:.2f} s/image, median {steps[len(steps) // 2] * 1e3:.1f} ms/step "
          f"(min {steps[0] * 1e3:.1f}, max {steps[-1] * 1e3:.1f})")
    print(f"GPU memory: weights {weights_gib:.2f} GiB, peak during generation "
          f"{torch.cuda.max_memory_allocated() / 2 ** 30:.2f} GiB; output {pixels.shape}")
    print(f"bf16 matmul 8192^3: {tflops:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
