"""What a server keeps after a burst of refused oversized gRPC requests.

gRPC has no message limit we can lower in Triton 2.51 (2 GiB), so a refused request of a few
hundred MB still passes through the server. Two refusals happen in different places:

* ``geometry``: a COND_KV whose dims differ from the checkpoint's ``[layers, 2, -1, kv_heads,
  head_dim]``. Triton's core refuses it against the auto-completed config; the model and its
  stub never see it, only tritonserver's gRPC buffers held it.
* ``tokens``: the right geometry with more tokens than ``max_prefix_tokens``. Triton copies it
  into the stub's shared-memory region first (which grows to fit and never shrinks); the model
  refuses it.

``python -m testing.grpc_memory`` measures both, with our settings (``MALLOC_ENV`` and no gRPC
request pool, neopp.launcher.tritonserver) and with Triton's and glibc's defaults, each on a fresh
server, and prints one line per case, with the time of a normal request in each setting.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from neopp.launcher.triton_install import MALLOC_ENV
from neopp.launcher.tritonserver import GRPC_POOL_ARG, TritonServer
from neopp.model.kv_cache import load_kv_file
from neopp.procs import process_group_members, rss_parts
from testing import REPO
from testing.tiny_checkpoint import write_sample_kv, write_tiny_checkpoint

MODEL = "neopp_dense"
MIB = 2**20


def kv_geometry(client: grpcclient.InferenceServerClient) -> list[int]:
    """``[layers, 2, -1, kv_heads, head_dim]`` as the model's metadata reports it."""
    meta = client.get_model_metadata(MODEL, as_json=True)
    return [int(d) for d in next(i for i in meta["inputs"] if i["name"] == "COND_KV")["shape"]]


def oversized_kv(geometry: list[int], nbytes: int, kind: str) -> grpcclient.InferInput:
    """A zero BF16 COND_KV of about ``nbytes``: wrong head_dim (``geometry``) or too many tokens."""
    layers, two, _, heads, head_dim = geometry
    if kind == "geometry":
        head_dim *= 2
    tokens = nbytes // (layers * two * heads * head_dim * 2)
    shape = [layers, two, tokens, heads, head_dim]
    tensor = grpcclient.InferInput("COND_KV", shape, "BF16")
    tensor._raw_content = bytes(int(np.prod(shape)) * 2)  # raw bytes: tritonclient's BF16 encoder is per element
    return tensor


def small_inputs(size: int = 32, steps: int = 2) -> list[grpcclient.InferInput]:
    """The scalar inputs of a request (offset, size, steps, seed)."""
    out = []
    for name, value in (("INDEX_OFFSET_COND", [24]), ("SIZE", [size, size]), ("STEPS", [steps]), ("SEED", [5])):
        tensor = grpcclient.InferInput(name, [len(value)], "INT64")
        tensor.set_data_from_numpy(np.array(value, np.int64))
        out.append(tensor)
    return out


def refused_burst(client: grpcclient.InferenceServerClient, kind: str, count: int, nbytes: int,
                  headers: dict[str, str] | None = None) -> list[str]:
    """Send ``count`` oversized requests one after the other (with ``headers``: an API key);
    returns each refusal's status."""
    geometry, answers = kv_geometry(client), []
    for _ in range(count):
        try:
            client.infer(MODEL, [oversized_kv(geometry, nbytes, kind), *small_inputs()], client_timeout=300,
                         headers=headers)
            answers.append("accepted")
        except InferenceServerException as exc:
            answers.append(f"{exc.status()}: {(exc.message() or '')[:90]}")
    return answers


def normal_request(client: grpcclient.InferenceServerClient, cond: np.ndarray, size: int = 32,
                   steps: int = 2) -> bytes:
    """One small valid request (what the server serves before "before" is measured)."""
    kv = grpcclient.InferInput("COND_KV", list(cond.shape), "BF16")
    kv.set_data_from_numpy(cond)
    cfg = grpcclient.InferInput("CFG_SCALE", [1], "FP32")
    cfg.set_data_from_numpy(np.array([1.0], np.float32))
    return bytes(client.infer(MODEL, [kv, cfg, *small_inputs(size, steps)], client_timeout=300).as_numpy("IMAGE")[0])


def server_memory(server: TritonServer) -> dict[str, int]:
    """RSS (anon, file, shmem) of tritonserver and every process of its group (its stubs)."""
    return rss_parts(process_group_members(server.process.pid))


@dataclass
class Measured:
    kind: str
    tuned: bool
    before: dict[str, int]
    after: dict[str, int]
    answers: list[str]
    request_s: float  # one 256x256 8-step request, mean of 3

    def line(self) -> str:
        b, a = self.before, self.after
        parts = ", ".join(f"{k} {b[k] / MIB:.1f} -> {a[k] / MIB:.1f}" for k in ("anon", "shmem"))
        return (f"{self.kind:8s} settings {'ours' if self.tuned else 'defaults'}: RSS {b['total'] / MIB:.1f} -> "
                f"{a['total'] / MIB:.1f} MiB (+{(a['total'] - b['total']) / b['total']:.1%}; {parts}); "
                f"256x256 8-step request {self.request_s:.2f}s; answers {sorted(set(self.answers))}")


def measure(checkpoint: Path, kind: str, tuned: bool, count: int, nbytes: int, log_dir: Path,
            extra: list[str] | None = None) -> Measured:
    """A fresh server with only ``neopp_dense``: one normal request, RSS, the burst, RSS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEOPP_CHECKPOINT")}
    env["NEOPP_CHECKPOINT"] = str(checkpoint)
    server = TritonServer(REPO / "model_repository", env=env, log_path=log_dir / f"{kind}_{tuned}.log",
                          malloc_env=MALLOC_ENV if tuned else {},
                          extra_args=["--model-control-mode=explicit", f"--load-model={MODEL}",
                                      *([] if tuned else [f"{GRPC_POOL_ARG}=8"]), *(extra or [])])
    with server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            cond = load_kv_file(checkpoint / "sample_kv" / "cond_kv.pt").float().numpy()
            normal_request(client, cond)
            started = time.monotonic()
            for _ in range(3):
                normal_request(client, cond, size=256, steps=8)
            seconds = (time.monotonic() - started) / 3
            before = server_memory(server)
            answers = refused_burst(client, kind, count, nbytes)
            after = server_memory(server)
        finally:
            client.close()
    return Measured(kind, tuned, before, after, answers, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=5)
    parser.add_argument("--mib", type=float, default=200.0)
    parser.add_argument("--kinds", nargs="+", default=["geometry", "tokens"])
    parser.add_argument("--settings", nargs="+", default=["defaults", "ours"], choices=["defaults", "ours"])
    parser.add_argument("extra", nargs="*", help="after --: extra tritonserver arguments")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_tiny_checkpoint(Path(tmp) / "dense", "dense")
        write_sample_kv(checkpoint / "sample_kv", "dense", cond_tokens=24, uncond_tokens=7)
        for kind in args.kinds:
            for setting in args.settings:
                result = measure(checkpoint, kind, setting == "ours", args.count, int(args.mib * MIB), Path(tmp),
                                 args.extra)
                print(result.line(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
