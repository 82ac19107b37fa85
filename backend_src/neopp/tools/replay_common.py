"""What both replay tools share: flags, the runner (one process or a torchrun mesh), turns.

Replay means regenerating images offline from KV prefixes saved by LightLLM (or by the
server's clients), with the same code that serves requests: `InProcessRunner` over a
`NeoPPPipeline`, or over a `ParallelPipeline` rank when the mode file has parallel sizes.
A parallel mode must be started as `torchrun --standalone --nproc_per_node=N` with N the
product of its parallel sizes; any other count is refused.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..contract.image_formats import FORMAT_OF_SUFFIX
from ..errors import ConfigError, InputError
from ..model.kv_cache import load_kv_file
from ..modes import CFG_NORMS, TASKS, ModeSpec, load_mode
from ..request import GenerationRequest
from ..runner import InProcessRunner
from ..sampling.rng import NoiseStream
from ..serving.request_log import request_line

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Turn:
    """One image: its prefixes, their offsets, and its seed (None: continue the stream)."""

    cond: Path  # the prompt's prefix file
    offset_cond: int  # the first position after it
    uncond: Path | None = None  # the unconditional prefix file, where guidance has one
    offset_uncond: int | None = None
    seed: int | None = None
    image: Path | None = None  # image editing: the input images without the prompt
    offset_image: int | None = None


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Checkpoint, mode, device and the sampling values a flag may override."""
    parser.add_argument("--checkpoint", required=True, help="checkpoint folder (config.json + safetensors)")
    parser.add_argument("--mode", required=True, help="mode file, e.g. configs/neopp/neopp_dense.json")
    parser.add_argument("--lora-dir", type=Path,
                        help="folder of the LoRA files the mode file names (default: the mode file's folder), "
                             "e.g. build/tiny/lora for the tiny checkpoint")
    parser.add_argument("--task", choices=TASKS, default="t2i")
    parser.add_argument("--size", type=int, nargs=2, metavar=("HEIGHT", "WIDTH"),
                        help="image size, multiples of 32 (default: the mode's)")
    parser.add_argument("--kv-layout", choices=("auto", "replay", "online"), default="auto",
                        help="layout of the KV files; auto: .pt is replay, safetensors say so in metadata")
    parser.add_argument("--device", default="auto", help="auto (cuda if present) | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="auto",
                        help="auto: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--state-in", type=Path, help="continue the stream saved by --state-out (no seed needed)")
    parser.add_argument("--state-out", type=Path, help="save the stream after the last image (NEXT_RNG_STATE bytes)")
    over = parser.add_argument_group("sampling overrides (default: the mode file's values)")
    over.add_argument("--steps", type=int, dest="infer_steps")
    over.add_argument("--cfg-scale", type=float)
    over.add_argument("--cfg-interval", type=float, nargs=2, metavar=("LOW", "HIGH"))
    over.add_argument("--cfg-norm", choices=CFG_NORMS)
    over.add_argument("--timestep-shift", type=float)
    over.add_argument("--image-guidance-scale", type=float,
                      help="image editing: the image branch's scale; other than 1 needs the image-branch KV")
    over.add_argument("--enable-cfg", dest="enable_cfg", action="store_true", default=None)
    over.add_argument("--no-cfg", dest="enable_cfg", action="store_false")


def parse_optional_int(text: str | None, what: str) -> int | None:
    if text is None or str(text).strip().lower() in ("", "none", "null", "-"):
        return None
    try:
        return int(text)
    except ValueError as exc:
        raise InputError(f"{what}: expected an integer or 'none', got {text!r}") from exc


def overrides(args: argparse.Namespace) -> dict:
    """Only the sampling flags that were given."""
    keys = ("infer_steps", "cfg_scale", "cfg_interval", "cfg_norm", "timestep_shift", "enable_cfg",
            "image_guidance_scale")
    return {k: getattr(args, k) for k in keys if getattr(args, k) is not None}


def output_format(path: Path) -> str:
    fmt = FORMAT_OF_SUFFIX.get(path.suffix.lower())
    if fmt is None:
        raise InputError(f"output {path}: extension must be one of {sorted(FORMAT_OF_SUFFIX)}")
    return fmt


class Replayer:
    """A runner plus what a rank needs to know: only rank 0 writes files and prints."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.mode: ModeSpec = load_mode(args.mode, lora_dir=args.lora_dir)
        self.rank, self.world_size = 0, self.mode.world_size
        dtype = DTYPES[args.dtype]
        device = None if args.device == "auto" else args.device
        pipeline = None
        if self.mode.world_size > 1:
            pipeline = self._parallel_pipeline(args.checkpoint, device, dtype)
        self.runner = InProcessRunner(args.checkpoint, self.mode, device=device, dtype=dtype,
                                  default_task=args.task, pipeline=pipeline)
        self.overrides = overrides(args)  # applied on every turn (the runner resets them per call)
        self.runner.set_inference_params(0, **self.overrides)  # checks the flags before any turn
        if args.state_in is not None:
            self.runner.noise_stream = NoiseStream.from_state(args.state_in.read_bytes())
        self.seeded = args.state_in is not None  # is there a stream to continue yet?
        self.size = tuple(args.size) if args.size else self.runner.default_size
        self.task, self.layout = args.task, None if args.kv_layout == "auto" else args.kv_layout

    def _parallel_pipeline(self, checkpoint: str, device: str | None, dtype: torch.dtype | None):
        from ..parallel.torchrun import rank_pipeline

        pipeline = rank_pipeline(checkpoint, self.mode, device, dtype)
        self.rank = pipeline.mesh.rank
        return pipeline

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def generate(self, turn: Turn, out_path: Path) -> bytes:
        """One image written to `out_path` (by rank 0); the stream moves on as on the server."""
        start = time.perf_counter()
        cond, uncond = self._load(turn)
        if turn.seed is None and not self.seeded and self.is_writer:
            print("warning: no seed and no --state-in: this image starts from a random stream and will not "
                  "reproduce", file=sys.stderr)
        self.seeded = True
        self.runner.set_inference_params(turn.offset_cond, turn.offset_uncond, output_format=output_format(out_path),
                                         index_offset_image=turn.offset_image, **self.overrides)
        if self.is_writer:
            out_path.parent.mkdir(parents=True, exist_ok=True)
        data = self.runner.generate(seed=turn.seed, size=self.size, task=self.task,
                                    save_result_path=str(out_path) if self.is_writer else "")
        if self.is_writer:
            print(self._line(turn, cond, uncond, out_path, len(data), time.perf_counter() - start), flush=True)
        return data

    def _line(self, turn: Turn, cond: torch.Tensor, uncond: torch.Tensor | None, out_path: Path, size: int,
              seconds: float) -> str:
        """The server's per-request line for this image, then where it went and from which seed."""
        req = GenerationRequest(cond_kv=cond, index_offset_cond=turn.offset_cond, height=self.size[0],
                                width=self.size[1], sampling_params=self.runner.sampling_params, uncond_kv=uncond,
                                index_offset_uncond=turn.offset_uncond, task=self.task)
        seed = turn.seed if turn.seed is not None else "continued"
        return (f"{request_line(self.mode.name, self.mode, req, size, seconds)} "
                f"output={out_path} seed={seed} offsets={turn.offset_cond}/{turn.offset_uncond}")

    def _load(self, turn: Turn) -> tuple[torch.Tensor, torch.Tensor | None]:
        cond = load_kv_file(turn.cond, self.layout)
        uncond = load_kv_file(turn.uncond, self.layout) if turn.uncond is not None else None
        if turn.image is None:
            self.runner.set_kvcache(cond, uncond)
        else:
            self.runner.set_kvcache_i2i(cond, uncond, load_kv_file(turn.image, self.layout))
        return cond, uncond

    def save_state(self, path: Path | None) -> None:
        if path is not None and self.is_writer:
            path.write_bytes(self.runner.noise_stream.state())

    def close(self) -> None:
        self.runner.pipeline.close()


def replay(args: argparse.Namespace, images: Sequence[tuple[Turn, Path]]) -> None:
    """Every (turn, output path) in order on one loaded runner, then the stream saved if asked.

    The mesh is torn down even when a turn fails, so a torchrun job never hangs in a collective.
    """
    replayer = Replayer(args)
    try:
        for turn, out_path in images:
            replayer.generate(turn, out_path)
        replayer.save_state(args.state_out)
    finally:
        replayer.close()


def run_main(run, argv: Sequence[str] | None, parser: argparse.ArgumentParser) -> int:
    """Parse, run, and turn the package's errors into one clear line and exit code 2."""
    args = parser.parse_args(argv)
    try:
        run(args)
    except InputError as exc:
        print(f"error: {exc.named(given_flags(args))}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


# Sampling field -> the flag that overrides it, so a refused value names what the user typed.
SAMPLING_FLAGS = {"infer_steps": "--steps", "cfg_scale": "--cfg-scale", "cfg_interval": "--cfg-interval",
                  "cfg_norm": "--cfg-norm", "timestep_shift": "--timestep-shift",
                  "image_guidance_scale": "--image-guidance-scale"}


def given_flags(args: argparse.Namespace) -> dict[str, str]:
    """The sampling fields a flag set (a mode file's own value keeps its field name)."""
    return {field: flag for field, flag in SAMPLING_FLAGS.items() if getattr(args, field, None) is not None}
