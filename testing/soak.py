"""``make soak``: one real server on the tiny checkpoints, then bad input, load, faults, shutdown.

Prints the figures docs/reliability.md records: malformed requests tried and refused as
expected, load requests and wrong images, crashes, resident memory after warm-up and after the
run, stub-kill recovery times, the SIGTERM outcome. Exit status 0 only when all hold.

    python -m testing.soak --seconds 600
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from neopp.launcher.tritonserver import TritonServer
from neopp.launcher.watchdog import StubWatchdog
from neopp.limits import Limits
from neopp.model.kv_cache import load_kv_file
from testing import REPO as REPO_ROOT
from testing.faults import STEPS_METRIC, kill_stub, metric, sigterm_in_flight
from testing.fuzz import generate_cases
from testing.loadgen import LoadRun, LoadSpec, image_bytes, infer, valid_inputs
from testing.tiny_checkpoint import tiny_config, tiny_tensors, write_sample_kv, write_tiny_checkpoint
from testing.tiny_lora import write_tiny_loras

MODELS = ("neopp_dense", "neopp_session", "neopp_dense_fp8", "neopp_dense_8steps", "neopp_moe")
OFFSETS = (24, 7)


def _checkpoints(root: Path) -> tuple[Path, Path]:
    dense = write_tiny_checkpoint(root / "dense", "dense")
    write_sample_kv(dense / "sample_kv", "dense", cond_tokens=OFFSETS[0], uncond_tokens=OFFSETS[1])
    lora = REPO_ROOT / "build" / "tiny" / "lora" / "neopp_8steps_lora.safetensors"  # found via NEOPP_LORA_DIR
    if not lora.is_file():
        write_tiny_loras(lora.parent, tiny_tensors(tiny_config("dense"), 0))
    return dense, write_tiny_checkpoint(root / "moe", "moe")


def _fuzz(server: TritonServer, cond: np.ndarray, n: int, seed: int) -> tuple[int, int, list[str]]:
    """``n`` malformed requests per protocol; (tried, refused as expected, unexpected outcomes)."""
    tried, good, bad = 0, 0, []
    for proto, client in (("grpc", grpcclient.InferenceServerClient(server.grpc_url)),
                          ("http", httpclient.InferenceServerClient(server.http_url))):
        params = client.get_model_config("neopp_dense", **({"as_json": True} if proto == "grpc" else {}))
        params = (params.get("config", params)).get("parameters", {})
        limits = Limits.from_params({k: v["string_value"] for k, v in params.items()})
        for case in generate_cases(n, seed, (cond.shape[0], cond.shape[3], cond.shape[4]), limits):
            tried += 1
            try:
                infer(client, "neopp_dense", case.inputs, timeout=60)
                bad.append(f"{proto} {case.label}: accepted")
            except InferenceServerException as exc:
                if exc.status() in ("StatusCode.INVALID_ARGUMENT", "400") and any(
                        name in (exc.message() or "") for name in case.names):
                    good += 1
                else:
                    bad.append(f"{proto} {case.label}: {exc.status()} {exc.message()[:160]}")
        client.close()
    return tried, good, bad


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testing.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_SECONDS", "600")))
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--fuzz", type=int, default=300, help="malformed requests per protocol")
    parser.add_argument("--seed", type=int, default=8101)
    ns = parser.parse_args(argv)
    ok = True
    with tempfile.TemporaryDirectory(prefix="neopp-soak-") as tmp:
        dense, moe = _checkpoints(Path(tmp))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NEOPP_CHECKPOINT", "NEOPP_LORA_DIR"))}
        env.update(NEOPP_CHECKPOINT=str(dense), NEOPP_CHECKPOINT_NEOPP_MOE=str(moe),
                   NEOPP_LORA_DIR=str(REPO_ROOT / "build" / "tiny" / "lora"))
        server = TritonServer(REPO_ROOT / "model_repository", env=env, log_path=Path(tmp) / "server.log",
                              extra_args=["--model-control-mode=explicit", "--exit-timeout-secs=15",
                                          *(f"--load-model={m}" for m in MODELS)])
        started = time.monotonic()
        server.start()
        try:
            server.wait_ready(timeout=600)
            print(f"server ready in {time.monotonic() - started:.1f}s with {', '.join(MODELS)}", flush=True)
            cond = load_kv_file(dense / "sample_kv" / "cond_kv.pt").float().numpy()
            uncond = load_kv_file(dense / "sample_kv" / "uncond_kv.pt").float().numpy()
            pid = server.process.pid

            tried, good, bad = _fuzz(server, cond, ns.fuzz, ns.seed)
            ok &= good == tried
            print(f"bad input: {tried} malformed requests, {good} refused as expected (INVALID_ARG naming the "
                  f"input), {len(bad)} otherwise {bad[:5]}", flush=True)

            spec = LoadSpec(cond, uncond, OFFSETS, clients=ns.clients)
            report = LoadRun(spec, server.grpc_url, server.http_url, pid).run(ns.seconds, warmup_s=5.0)
            ok &= not report.errors and not report.mismatches and abs(report.rss_change) <= 0.10
            print(f"load ({ns.clients} clients, gRPC and HTTP): {report.summary()}", flush=True)
            for line in (report.errors + report.mismatches)[:5]:
                print("   ", line)

            client = grpcclient.InferenceServerClient(server.grpc_url)
            valid = valid_inputs(cond, uncond, OFFSETS, seed=3)
            expected = image_bytes(infer(client, "neopp_dense", valid))
            long = {**valid, "SIZE": (np.array([512, 512], np.int64), "INT64"),
                    "STEPS": (np.array([200], np.int64), "INT64")}
            with StubWatchdog(grpcclient.InferenceServerClient(server.grpc_url), pid, log=lambda m: None) as dog:
                between = kill_stub(client, pid, "neopp_dense", valid, expected, timeout=120)
                during = kill_stub(client, pid, "neopp_dense", valid, expected, during=long,
                                   metrics_url=server.metrics_url, timeout=120)
            for name, k in (("between requests", between), ("during a request", during)):
                ok &= k.recovery_s is not None and k.same_bytes
                print(f"stub killed {name}: in-flight answer {k.in_flight!r}; later requests saw "
                      f"{k.seen_errors}; recovered (expected bytes) after {k.recovery_s:.2f}s, "
                      f"{k.attempts} attempts; watchdog reload {[round(r.reload_s, 2) for r in dog.recoveries]} s",
                      flush=True)
            crashes = 0 if server.process.poll() is None else 1
            client.close()
            ok &= crashes == 0
            print(f"server crashes: {crashes}", flush=True)

            requests = [valid_inputs(cond, uncond, OFFSETS, seed=s) for s in range(3)] + [long] * 2
            shutdown = sigterm_in_flight(server, lambda: grpcclient.InferenceServerClient(server.grpc_url),
                                         "neopp_dense", requests,
                                         started=lambda: metric(server.metrics_url, STEPS_METRIC,
                                                                model="neopp_dense") >= 1, group=True)
            ok &= shutdown.unanswered == 0 and not shutdown.left_behind
            print(f"SIGTERM to the server's process group with {len(requests)} requests in flight: "
                  f"answers {shutdown.answers}, late request "
                  f"{shutdown.late!r}; server exited {shutdown.exit_code} after {shutdown.stop_s:.1f}s; "
                  f"left behind {shutdown.left_behind}", flush=True)
        finally:
            server.stop(timeout=30)
    print("SOAK " + ("PASSED" if ok else "FAILED"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
