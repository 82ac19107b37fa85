"""Write perf_analyzer ``--input-data`` JSON for the generation models at a given KV size.

    python client_examples/make_perf_data.py --kv-dims 2 2 32 --cond-tokens 24 --uncond-tokens 7 \
        --size 64 64 --steps 4 --out build/perf_data.json

``--kv-dims`` is (layers, kv_heads, head_dim) of the served checkpoint; ``--from-server URL``
reads it from the model metadata (HTTP) instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def perf_input_data(kv_dims: tuple[int, int, int], cond_tokens: int, uncond_tokens: int | None = None,
                    size: tuple[int, int] = (64, 64), steps: int | None = None, seed: int | None = 0,
                    output_format: str = "png", offsets: tuple[int, int] = (0, 0), kv_seed: int = 0) -> dict:
    """perf_analyzer ``--input-data`` JSON for one request of the generation models.

    The BF16 KV goes as base64 of its raw little-endian bytes, which perf_analyzer sends
    unchanged; ``kv_dims`` is (layers, kv_heads, head_dim) as the model metadata reports.
    """
    import base64

    import torch

    layers, kv_heads, head_dim = kv_dims
    gen = torch.Generator().manual_seed(kv_seed)

    def kv(tokens: int) -> dict:
        shape = [layers, 2, tokens, kv_heads, head_dim]
        raw = torch.randn(shape, generator=gen).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        return {"b64": base64.b64encode(raw).decode("ascii"), "shape": shape}

    request: dict = {
        "COND_KV": kv(cond_tokens),
        "INDEX_OFFSET_COND": {"content": [offsets[0]], "shape": [1]},
        "SIZE": {"content": [int(size[0]), int(size[1])], "shape": [2]},
        "OUTPUT_FORMAT": {"content": [output_format], "shape": [1]},
    }
    if uncond_tokens:
        request["UNCOND_KV"] = kv(uncond_tokens)
        request["INDEX_OFFSET_UNCOND"] = {"content": [offsets[1]], "shape": [1]}
    else:
        request["CFG_SCALE"] = {"content": [1.0], "shape": [1]}  # no guidance without an uncond prefix
    if steps is not None:
        request["STEPS"] = {"content": [int(steps)], "shape": [1]}
    if seed is not None:
        request["SEED"] = {"content": [int(seed)], "shape": [1]}
    return {"data": [request]}


def kv_dims_from_server(url: str, model: str) -> tuple[int, int, int]:
    """COND_KV's [layers, 2, -1, kv_heads, head_dim] from the model's metadata."""
    import tritonclient.http as httpclient

    meta = httpclient.InferenceServerClient(url).get_model_metadata(model)
    shape = next(i["shape"] for i in meta["inputs"] if i["name"] == "COND_KV")
    layers, _, _, kv_heads, head_dim = (int(v) for v in shape)
    if min(layers, kv_heads, head_dim) < 1:
        raise SystemExit(f"{model} metadata does not state the KV geometry: {shape}")
    return layers, kv_heads, head_dim


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--kv-dims", type=int, nargs=3, metavar=("LAYERS", "KV_HEADS", "HEAD_DIM"))
    src.add_argument("--from-server", metavar="HTTP_URL", help="e.g. localhost:8000")
    p.add_argument("--model", default="neopp_dense")
    p.add_argument("--cond-tokens", type=int, required=True)
    p.add_argument("--uncond-tokens", type=int, default=0, help="0: no uncond prefix, CFG_SCALE 1")
    p.add_argument("--size", type=int, nargs=2, default=(64, 64), metavar=("H", "W"))
    p.add_argument("--steps", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", default="png", choices=("jpeg", "png", "webp"))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    dims = tuple(args.kv_dims) if args.kv_dims else kv_dims_from_server(args.from_server, args.model)
    data = perf_input_data(dims, args.cond_tokens, args.uncond_tokens or None, tuple(args.size),
                           args.steps, args.seed, args.format, offsets=(args.cond_tokens, args.uncond_tokens))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data))
    print(f"wrote {args.out} (KV dims {dims}, {args.cond_tokens}+{args.uncond_tokens} tokens)")


if __name__ == "__main__":
    main()
