"""Prompt in, image out over gRPC, with a progress bar while the server denoises: the prompt
encoder's KV prefix goes to the generation model's streamed twin (neopp_dense_stream for
neopp_dense), which reports every step; the image is the one neopp_t2i draws for the same seed.
Where the twin is not served, or with --no-progress, one request to neopp_t2i does both steps in
the server. A request the server refuses is one line on stderr (status and message) and exit
code 1."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from stream_grpc import stream_to_image
from t2i_common import GRPC_URL, api_headers, free_default_path, infer_inputs, run_client

EXAMPLE = ("example (after `make serve`, from the repository root):\n"
           "  python client_examples/prompt_t2i.py --url localhost:8001 \\\n"
           '    "a red circle on the left on a blue background" --size 256 256 --seed 42 --steps 20 -o out.png')


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, epilog=EXAMPLE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the text the image should show")
    p.add_argument("--negative", help="NEGATIVE_PROMPT (default: none, the unconditional branch)")
    p.add_argument("--url", default=GRPC_URL, help=f"server gRPC address (default {GRPC_URL})")
    p.add_argument("--model", help="generation model behind neopp_t2i (default: the server's, neopp_dense)")
    p.add_argument("--size", type=int, nargs=2, metavar=("H", "W"),
                   help="multiples of 32 (default: the model's own, its checkpoint's: 256x256 for the demo)")
    p.add_argument("--seed", type=int, help="start a seeded stream (same seed, same image)")
    p.add_argument("--steps", type=int)
    p.add_argument("--cfg-scale", type=float)
    p.add_argument("--format", choices=("jpeg", "png", "webp"), default="png")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the client gives up")
    p.add_argument("--no-progress", action="store_true", help="one neopp_t2i request, no progress bar")
    p.add_argument("-o", "--out", type=Path, default=None,
                   help="image path (default outputs/out.png, or out-2.png... where taken)")
    return p


def request_tensors(args: argparse.Namespace) -> list[grpcclient.InferInput]:
    """The inputs the arguments set; the server's defaults fill in the rest."""
    def text(value: str) -> tuple[np.ndarray, str]:
        return np.array([value.encode()], dtype=np.object_), "BYTES"

    given = {"PROMPT": text(args.prompt), "OUTPUT_FORMAT": text(args.format)}
    if args.size is not None:
        given["SIZE"] = (np.array(args.size, dtype=np.int64), "INT64")
    if args.negative is not None:
        given["NEGATIVE_PROMPT"] = text(args.negative)
    if args.model:
        given["MODEL"] = text(args.model)
    if args.seed is not None:
        given["SEED"] = (np.array([args.seed], dtype=np.int64), "INT64")
    if args.steps is not None:
        given["STEPS"] = (np.array([args.steps], dtype=np.int64), "INT64")
    if args.cfg_scale is not None:
        given["CFG_SCALE"] = (np.array([args.cfg_scale], dtype=np.float32), "FP32")
    return infer_inputs(grpcclient, [(name, array, datatype) for name, (array, datatype) in given.items()])


ENCODER, ENCODED = "neopp_prompt_encoder", ("COND_KV", "UNCOND_KV", "INDEX_OFFSET_COND", "INDEX_OFFSET_UNCOND")
DEFAULT_MODEL = "neopp_dense"  # neopp_t2i's default_model in the shipped repository


def streamed(client: grpcclient.InferenceServerClient, args: argparse.Namespace) -> bytes:
    """The prompt encoder, then the generation model's streamed twin with a progress bar: the same
    inputs neopp_t2i forwards, so the same image."""
    prompts = [t for t in request_tensors(args) if t.name() in ("PROMPT", "NEGATIVE_PROMPT")]
    encoded = client.infer(ENCODER, prompts, client_timeout=args.timeout, headers=api_headers())
    prefix = [(name, encoded.as_numpy(name), "BF16" if name.endswith("_KV") else "INT64") for name in ENCODED]
    passed = [t for t in request_tensors(args) if t.name() not in ("PROMPT", "NEGATIVE_PROMPT", "MODEL")]
    twin = (args.model or DEFAULT_MODEL) + "_stream"
    result = stream_to_image(client, twin, infer_inputs(grpcclient, prefix) + passed, args.timeout)
    return result.as_numpy("IMAGE")[0]


def main() -> None:
    args = build_parser().parse_args()
    client = grpcclient.InferenceServerClient(args.url)
    try:
        twin = (args.model or DEFAULT_MODEL) + "_stream"
        if not args.no_progress and client.is_model_ready(twin):
            image = streamed(client, args)
        else:
            image = client.infer("neopp_t2i", request_tensors(args), client_timeout=args.timeout,
                                 headers=api_headers()).as_numpy("IMAGE")[0]
    finally:
        client.close()
    out = args.out or free_default_path("png")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(image)
    print(f"wrote {out} ({len(image)} bytes)")


if __name__ == "__main__":
    raise SystemExit(run_client(main))
