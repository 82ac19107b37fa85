"""The GPU check's modes: build a pipeline per mode (random 8B tower on the device, or a checkpoint)
and run one timed generation, in this process or as the ranks of a CFG / Ulysses mesh.

Everything but the CUDA calls is device-neutral, so `--device cpu` runs the same code (gloo
instead of NCCL for the ranks).
"""

from __future__ import annotations

import dataclasses
import gc
import queue
import resource
import socket
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from bench.geometry import EIGHT_B, MOE, BenchGeometry, random_tower_tensors
from neopp.model.checkpoint import load_checkpoint
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.model.lora import check_pair, read_lora_pairs
from neopp.model.quant import fp8_layer_linear, quantize_layer_linears_
from neopp.model.speed import SpeedOptions
from neopp.model.transformer import NeoPPTransformer
from neopp.modes import ModeSpec, SamplingParams
from neopp.parallel.mesh import backend_for, build_mesh, leave_mesh
from neopp.parallel.parallel_pipeline import CommTimer, ParallelPipeline, check_heads
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing.tiny_lora import tiny_lora_tensors

PREFIX_UNCOND = 12


@dataclass(frozen=True)
class CheckSpec:
    """What every mode shares: device kind, geometry, image, and an optional checkpoint."""

    device: str = "cuda"
    layers: int = 36
    shrink: int = 1  # divide widths and head counts (CPU smoke runs only)
    size: int = 1024
    steps: int = 50
    lora_steps: int = 8
    prefix: int = 300
    moe_layers: int = 48
    moe_experts: int = 128
    moe_steps: int = 20
    checkpoint: str | None = None

    def geometry(self, moe: bool) -> BenchGeometry:
        """The tower of a dense or MoE mode, shrunk for a CPU smoke run."""
        base = replace(MOE, layers=self.moe_layers, experts=self.moe_experts) if moe else \
            replace(EIGHT_B, layers=self.layers)
        return base.shrunk(self.shrink)


@dataclass(frozen=True)
class ModeRun:
    name: str
    mode: ModeSpec
    moe: bool = False
    steps: int | None = None


def mode_runs(spec: CheckSpec, devices: int) -> list[ModeRun]:
    """Every mode `devices` allow: 1-device modes, then CFG-parallel (2), then CFG + Ulysses (4)."""
    lora_file = ({"path": "random", "strength": 1.0},)
    runs = [
        ModeRun("dense bf16", ModeSpec(name="dense")),
        ModeRun("fp8", ModeSpec(name="fp8", dit_quantized=True, dit_quant_scheme="fp8-sgl")),
        ModeRun(
            "8-step LoRA",
            ModeSpec(name="8steps", lora_configs=lora_file, sampling_params=SamplingParams(enable_cfg=False)),
            steps=spec.lora_steps,
        ),
        ModeRun("MoE", ModeSpec(name="moe", version="moe"), moe=True, steps=spec.moe_steps),
    ]
    if devices >= 2:
        runs.append(ModeRun("CFG-parallel x2", ModeSpec(name="cfg", cfg_p_size=2)))
    if devices >= 4:
        runs.append(ModeRun("CFG x2 + Ulysses x2", ModeSpec(name="cfg_seq", cfg_p_size=2, seq_p_size=2)))
    return runs


def write_random_lora(tensors: dict[str, torch.Tensor], folder: Path) -> Path:
    """A random rank-4 LoRA file on the attention and MLP linears (as the 8-step LoRA targets)."""
    from safetensors.torch import save_file

    ends = (
        "q_proj_mot_gen.weight",
        "v_proj_mot_gen.weight",
        "o_proj_mot_gen.weight",
        "mlp_mot_gen.up_proj.weight",
        "mlp_mot_gen.down_proj.weight",
    )
    targets = sorted(k for k in tensors if k.endswith(ends))
    path = folder / "lora.safetensors"
    save_file(tiny_lora_tensors({k: tensors[k] for k in targets}, targets, "up_down"), str(path))
    return path


def merge_on_device(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """The file's factors, read and checked by the loader's own code, merged where the weights
    live (the loader's merge expects CPU tensors, as a checkpoint load gives)."""
    for pair in read_lora_pairs(path).values():
        key = check_pair(pair, tensors, path)
        dev = tensors[key].device
        delta = dataclasses.replace(pair, up=pair.up.to(dev), down=pair.down.to(dev)).delta(1.0)
        tensors[key] = (tensors[key].float() + delta).to(tensors[key].dtype)


def build(spec: CheckSpec, run: ModeRun, device: torch.device, dtype: torch.dtype) -> NeoPPPipeline:
    """The mode's pipeline: from the checkpoint through `from_pretrained`, else a random tower."""
    cls = ParallelPipeline if run.mode.world_size > 1 else NeoPPPipeline
    if spec.checkpoint:
        with tempfile.TemporaryDirectory() as tmp:
            mode = run.mode
            if mode.lora_configs:
                path = write_random_lora(load_checkpoint(spec.checkpoint)[1], Path(tmp))
                mode = dataclasses.replace(mode, lora_configs=({"path": str(path), "strength": 1.0},))
            pipe = NeoPPPipeline.from_pretrained(spec.checkpoint, mode, str(device), dtype)
        return pipe if cls is NeoPPPipeline else cls(pipe.config, pipe.transformer, run.mode, device, dtype)
    geo = spec.geometry(run.moe)
    cfg = CheckpointConfig.from_dict(geo.config())
    tensors = random_tower_tensors(cfg, device, dtype, geo.mlp, geo.head_width)
    layer_linear = None
    if run.mode.lora_configs:
        with tempfile.TemporaryDirectory() as tmp:
            merge_on_device(tensors, write_random_lora(tensors, Path(tmp)))
    if run.mode.dit_quantized:
        quantize_layer_linears_(tensors)
        layer_linear = fp8_layer_linear(device)
    tower = NeoPPTransformer.from_tensors(cfg, tensors, device, dtype, layer_linear)
    return cls(cfg, tower, run.mode, device, dtype)


def request(
    pipe: NeoPPPipeline, spec: CheckSpec, run: ModeRun, steps: int | None = None
) -> GenerationRequest:
    cfg, dev, dtype = pipe.config, pipe.device, pipe.dtype
    gen = torch.Generator(device=dev).manual_seed(1)

    def kv(tokens: int) -> torch.Tensor:
        shape = (cfg.num_layers, 2, tokens, cfg.num_kv_heads, cfg.head_dim)
        return torch.randn(shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)

    sampling = dataclasses.replace(run.mode.sampling_params, infer_steps=steps or run.steps or spec.steps)
    return GenerationRequest(
        cond_kv=kv(spec.prefix),
        uncond_kv=kv(PREFIX_UNCOND),
        index_offset_cond=spec.prefix,
        index_offset_uncond=PREFIX_UNCOND,
        height=spec.size,
        width=spec.size,
        noise=NoiseStream(200).draw(spec.size, spec.size),
        sampling_params=sampling,
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's high-water mark


def timed_generation(pipe: NeoPPPipeline, spec: CheckSpec, run: ModeRun) -> dict:
    """A 2-step warm-up, then the timed image; step seconds, total, peak memory and pixels."""
    pipe.validate(request(pipe, spec, run))
    began = time.perf_counter()
    pipe.generate(request(pipe, spec, run, steps=2))
    sync(pipe.device)
    warmup_s = time.perf_counter() - began
    if pipe.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(pipe.device)
    steps: list[float] = []
    start = time.perf_counter()
    pixels = pipe.generate(request(pipe, spec, run), on_step=lambda k, s: steps.append(s))
    sync(pipe.device)
    return {
        "steps": steps,
        "total_s": time.perf_counter() - start,
        "peak": peak_bytes(pipe.device),
        "pixels": pixels,
        "batched": pipe.batch_cfg((spec.size // 32) ** 2),
        "warmup_s": warmup_s,
    }


# The speed paths each one-device mode is measured on, one tower, side by side: today's eager step,
# the same kernels through CUDA graphs (must be the same bytes), and the served default (graphs and
# the attention kernel measured fastest per shape), and the default with compiled layers (its
# warm-up, which compiles, is reported as its start cost).
SPEED_PATHS = {
    "eager": SpeedOptions(cuda_graphs="off", attention_kernel="default"),
    "graphs": SpeedOptions(cuda_graphs="auto", attention_kernel="default"),
    "default": SpeedOptions(),
    "compiled": SpeedOptions(compile_layers="on"),
}


def run_local(spec: CheckSpec, run: ModeRun, device: torch.device, dtype: torch.dtype,
              small_sizes: tuple[int, ...] = (), path_names: tuple[str, ...] = tuple(SPEED_PATHS)) -> dict:
    """The speed paths ``path_names`` on one tower; the default path's figures at the top level, the others by
    name, and (``small_sizes``) a guided step's time at small sizes on those paths."""
    start = time.perf_counter()
    pipe = build(spec, run, device, dtype)
    sync(device)
    build_s = time.perf_counter() - start
    paths, timings = {}, {}
    for name in path_names:
        pipe.use_speed(SPEED_PATHS[name])
        try:
            paths[name] = timed_generation(pipe, spec, run)
        except Exception as exc:  # noqa: BLE001 - one failed path is reported; the others still run
            paths[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        graphs = pipe.layer_graphs
        paths[name]["graphs"] = (graphs.captures, graphs.replays, graphs.enabled) if graphs else None
        timings.update(pipe.attention.timings)  # the kernels the default path measured
    small: dict[int, dict[str, float]] = {size: {} for size in small_sizes}
    for name in (p for p in ("eager", "default", "compiled") if p in path_names):
        pipe.use_speed(SPEED_PATHS[name])
        for size in small_sizes:
            try:
                small[size][name] = small_step_s(pipe, spec, run, size)
            except Exception:  # noqa: BLE001 - reported as not measured
                continue
    timings.update(pipe.attention.timings)
    del pipe
    release(device)
    return {**paths["eager"], **paths.get("default", {}), "build_s": build_s, "paths": paths, "small": small,
            "attention": timings}


def small_step_s(pipe: NeoPPPipeline, spec: CheckSpec, run: ModeRun, size: int, steps: int = 20) -> float:
    """Median seconds of a guided step at ``size`` (after a warm-up image of the same size)."""
    small = replace(spec, size=size)
    pipe.generate(request(pipe, small, run, steps=3))
    times: list[float] = []
    pipe.generate(request(pipe, small, run, steps=steps), on_step=lambda k, s: times.append(s))
    return sorted(times)[len(times) // 2]


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, spec: CheckSpec, run: ModeRun, port: int, dtype: torch.dtype, results) -> None:
    """One rank of a parallel mode; rank 0 reports. Same seed per key: every rank draws the same tower."""
    device = torch.device(f"cuda:{rank}") if spec.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = run.mode.world_size
    dist.init_process_group(
        backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        mesh = build_mesh(run.mode, rank, world)
        start = time.perf_counter()
        pipe = build(spec, run, device, dtype)
        check_heads(pipe.config, run.mode)
        pipe.mesh, pipe.comm = mesh, CommTimer()
        build_s = time.perf_counter() - start
        out = timed_generation(pipe, spec, run)
        if rank == 0:
            results.put({**out, "build_s": build_s, "comm_s": pipe.comm.seconds})
    finally:
        leave_mesh()  # the ranks meet before their groups go: a gloo rank torn down early aborts its peer


def run_ranks(spec: CheckSpec, run: ModeRun, dtype: torch.dtype) -> dict:
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = torch.multiprocessing.start_processes(
        rank_main,
        (spec, run, free_port(), dtype, results),
        nprocs=run.mode.world_size,
        join=False,
        start_method="spawn",
    )
    out = None
    while out is None:  # read before joining: a rank cannot exit while its result sits in the pipe
        try:
            out = results.get(timeout=1.0)
        except queue.Empty:
            if procs.join(timeout=0):  # all ranks ended (join raises if one failed)
                raise RuntimeError(f"{run.name}: ranks ended without a result") from None
    while not procs.join():
        pass
    return out


def pixel_agreement(a: np.ndarray, b: np.ndarray) -> dict:
    """Differences in 8-bit levels between two images of the same request."""
    diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return {"max": int(diff.max()), "mean": float(diff.mean()), "within2": float((diff <= 2).mean())}
