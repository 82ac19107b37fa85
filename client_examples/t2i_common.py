"""What grpc_t2i.py and http_t2i.py share: flags, the request's tensors, saving the answer.

tritonclient.grpc and tritonclient.http build tensors with the same calls, so the module of the
transport is passed in and only the client itself differs between the two examples.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from tritonclient.utils import InferenceServerException

from neopp.cli.client import CliError, server_addresses
from neopp.model.kv_cache import load_kv_file


def default_addresses(neopp_url: str | None) -> tuple[str, str]:
    """The server the examples call when --url is not given: NEOPP_URL's (its gRPC address asked
    of it), else make serve's default ports."""
    if not neopp_url:
        return "localhost:8000", "localhost:8001"
    try:
        return server_addresses(neopp_url)
    except CliError as exc:
        sys.exit(f"error: {exc} (NEOPP_URL)")


HTTP_URL, GRPC_URL = default_addresses(os.environ.get("NEOPP_URL"))
API_KEY_ENV = "NEOPP_API_KEY"  # what a server beyond loopback wants for inference


def api_headers(grpc: bool = True) -> dict[str, str] | None:
    """The API key ($NEOPP_API_KEY) as the transport sends it: ``Authorization: Bearer`` over
    HTTP, the same value under Triton's restricted-protocol prefix over gRPC; None without one."""
    key = os.environ.get(API_KEY_ENV, "").strip()
    if not key:
        return None
    return {"triton-grpc-protocol-authorization" if grpc else "authorization": f"Bearer {key}"}


def example(script: str, url: str, extra: str = "") -> str:
    """A command that works against ``make serve`` (the demo model), for ``--help``."""
    return ("example (after `make serve`, from the repository root):\n"
            f"  python client_examples/{script} --url {url} \\\n"
            "    --cond demo/checkpoints/dense/sample_kv/cond_kv.pt \\\n"
            "    --uncond demo/checkpoints/dense/sample_kv/uncond_kv.pt \\\n"
            f"    --offset-cond 11 --offset-uncond 1 --size 256 256 --steps 20 --seed 42 --out outputs/out.png{extra}")


def build_parser(description: str, default_url: str, script: str, example_extra: str = "") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, epilog=example(script, default_url, example_extra),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=default_url, help=f"server address (default {default_url})")
    p.add_argument("--model", default="neopp_dense")
    p.add_argument("--cond", required=True, help="cond KV file (.pt or .safetensors)")
    p.add_argument("--uncond", help="uncond KV file; needed when guidance is on (else pass --cfg-scale 1)")
    p.add_argument("--layout", choices=("replay", "online"), default=None,
                   help="KV layout of the files (default: replay for .pt, the file's tag for safetensors)")
    p.add_argument("--offset-cond", type=int, required=True, help="INDEX_OFFSET_COND")
    p.add_argument("--offset-uncond", type=int, help="INDEX_OFFSET_UNCOND (with --uncond)")
    p.add_argument("--size", type=int, nargs=2, metavar=("H", "W"), help="multiples of 32")
    p.add_argument("--resize", type=int, nargs=2, metavar=("H", "W"), help="delivered size (Lanczos)")
    p.add_argument("--steps", type=int)
    p.add_argument("--seed", type=int, help="start a seeded stream (omit to continue the server's)")
    p.add_argument("--rng-state", type=Path, help="continue a stream saved with --save-rng-state")
    p.add_argument("--save-rng-state", type=Path, help="write NEXT_RNG_STATE here")
    p.add_argument("--cfg-scale", type=float)
    p.add_argument("--cfg-interval", type=float, nargs=2, metavar=("LOW", "HIGH"))
    p.add_argument("--cfg-norm", choices=("global", "channel", "none"))
    p.add_argument("--timestep-shift", type=float)
    p.add_argument("--task", choices=("t2i", "i2i"))
    p.add_argument("--format", choices=("jpeg", "png", "webp"), default="png")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the client gives up")
    p.add_argument("--out", type=Path, default=None,
                   help="image path (default: outputs/out.<format>, or out-2... where taken)")
    return p


def request_inputs(args: argparse.Namespace) -> list[tuple[str, np.ndarray, str]]:
    """(name, array, Triton datatype) for every input the arguments set.

    KV tensors travel as float32 arrays tagged BF16: the client converts them, exactly for
    values that were bfloat16 to begin with.
    """
    def kv(path: str) -> np.ndarray:
        return load_kv_file(path, args.layout).float().contiguous().numpy()

    def i64(*values: int) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    def f32(*values: float) -> np.ndarray:
        return np.array(values, dtype=np.float32)

    def text(value: str) -> np.ndarray:
        return np.array([value.encode()], dtype=np.object_)

    inputs = [("COND_KV", kv(args.cond), "BF16"), ("INDEX_OFFSET_COND", i64(args.offset_cond), "INT64")]
    if args.uncond:
        if args.offset_uncond is None:
            raise SystemExit("--offset-uncond is required with --uncond")
        inputs += [("UNCOND_KV", kv(args.uncond), "BF16"), ("INDEX_OFFSET_UNCOND", i64(args.offset_uncond), "INT64")]
    optional = [
        ("SIZE", args.size and i64(*args.size), "INT64"),
        ("RESIZE", args.resize and i64(*args.resize), "INT64"),
        ("STEPS", args.steps is not None and i64(args.steps), "INT64"),
        ("SEED", args.seed is not None and i64(args.seed), "INT64"),
        ("RNG_STATE", args.rng_state and np.fromfile(args.rng_state, dtype=np.uint8), "UINT8"),
        ("CFG_SCALE", args.cfg_scale is not None and f32(args.cfg_scale), "FP32"),
        ("CFG_INTERVAL", args.cfg_interval and f32(*args.cfg_interval), "FP32"),
        ("CFG_NORM", args.cfg_norm and text(args.cfg_norm), "BYTES"),
        ("TIMESTEP_SHIFT", args.timestep_shift is not None and f32(args.timestep_shift), "FP32"),
        ("TASK", args.task and text(args.task), "BYTES"),
        ("OUTPUT_FORMAT", text(args.format), "BYTES"),
    ]
    return inputs + [(name, arr, dt) for name, arr, dt in optional if arr is not None and arr is not False]


def infer_inputs(client_module: ModuleType, inputs: list[tuple[str, np.ndarray, str]], **data_options: Any) -> list:
    """(name, array, datatype) triples as `client_module.InferInput` tensors (HTTP: binary_data=True)."""
    tensors = []
    for name, array, datatype in inputs:
        tensor = client_module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, **data_options)
        tensors.append(tensor)
    return tensors


def triton_inputs(client_module: ModuleType, args: argparse.Namespace, **data_options: Any) -> list:
    """The request as `client_module.InferInput` tensors (HTTP passes binary_data=True)."""
    return infer_inputs(client_module, request_inputs(args), **data_options)


def requested_outputs(client_module: ModuleType, **options: Any) -> list:
    return [client_module.InferRequestedOutput(name, **options) for name in ("IMAGE", "NEXT_RNG_STATE")]


def free_default_path(suffix: str) -> Path:
    """``outputs/out.<suffix>``, or ``out-2``, ``out-3``... where taken: a default name never
    overwrites an earlier picture (a path given with ``--out`` is written as asked)."""
    path, n = Path("outputs") / f"out.{suffix}", 2
    while path.exists():
        path, n = path.with_name(f"out-{n}.{suffix}"), n + 1
    return path


def save_result(args: argparse.Namespace, result: Any) -> Path:
    """Write IMAGE to --out (default outputs/out.<format>) and NEXT_RNG_STATE to --save-rng-state if given."""
    image = result.as_numpy("IMAGE")[0]
    out = args.out or free_default_path("jpg" if args.format == "jpeg" else args.format)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(image)
    if args.save_rng_state:
        result.as_numpy("NEXT_RNG_STATE").astype(np.uint8).tofile(args.save_rng_state)
    print(f"wrote {out} ({len(image)} bytes)")
    return out


def run_client(main: Callable[[], None]) -> int:
    """Exit code of a client run: a refused request or an unreachable server is one line on
    stderr (the status and the server's own message) and exit code 1, never a traceback."""
    try:
        main()
    except InferenceServerException as exc:
        status = str(exc.status() or "error")
        print(f"{'HTTP ' + status if status.isdigit() else status}: {exc.message()}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:  # no server there, a KV file that cannot be read, ...
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
