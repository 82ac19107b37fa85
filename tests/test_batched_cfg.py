"""Batched CFG (both branches in one forward) equals two sequential passes.

Both paths run the same float32 kernels on the same rows; only matmul blocking over a
taller batch differs, so results agree to float32 reassociation (1e-5 on O(10) states).
The reference comparisons cover the batched path (chosen automatically at these sizes);
this test pins the sequential path to it.
"""

import torch

from neopp.model.kv_cache import load_kv_file
from neopp.modes import SamplingParams
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing.tiny_checkpoint import write_sample_kv, write_tiny_checkpoint


def test_batched_and_sequential_cfg_agree(tmp_path):
    for variant in ("dense", "pixel"):
        ckpt = write_tiny_checkpoint(tmp_path / variant, variant, seed=7)
        kv = write_sample_kv(tmp_path / f"{variant}_kv", variant, cond_tokens=13, uncond_tokens=3)
        pipe = NeoPPPipeline.from_pretrained(ckpt, device="cpu", dtype=torch.float32)
        req = GenerationRequest(cond_kv=load_kv_file(kv["cond_pt"]), uncond_kv=load_kv_file(kv["uncond_pt"]),
                                index_offset_cond=20, index_offset_uncond=3, height=64, width=96,
                                noise=NoiseStream(3).draw(64, 96),
                                sampling_params=SamplingParams(infer_steps=3, cfg_norm="channel"))
        results = {}
        for mode in ("on", "off"):
            pipe.cfg_batching = mode
            results[mode] = pipe.sample(req)
        assert (results["on"] - results["off"]).abs().max().item() < 1e-5
        unguided = pipe.sample(GenerationRequest(**{**req.__dict__, "sampling_params": SamplingParams(infer_steps=3,
                                                                                               enable_cfg=False)}))
        assert (results["on"] - unguided).abs().max().item() > 1e-2
