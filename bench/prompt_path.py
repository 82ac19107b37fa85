"""A person's path from a prompt to a picture: how long until the first sign of life and the picture.

The demo model served as ``make serve`` serves it (the launcher, the door in front), called the
three ways a person calls it, in interleaved rounds: the OpenAI Images API plain (one answer)
and streamed (``partial_images`` 3: previews, then the picture), and ``prompt_t2i.py``'s gRPC path
(the prompt encoder, then the streamed twin: a progress event per step). Every call draws the
same prompt at the model's own defaults (its checkpoint's 256x256, the mode's 50 steps).

    python -m bench.prompt_path [--repeats 5] [--out bench]
"""

from __future__ import annotations

import argparse
import queue
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import openai
import tritonclient.grpc as grpcclient

from bench.common import REPO, section_main, stats
from neopp.contract.inputs import ENCODER_OUTPUTS
from testing.launched import Launched, launch

PROMPT = "a red circle on the left on a blue background"
MODELS = ("neopp_dense", "neopp_dense_stream", "neopp_prompt_encoder", "neopp_t2i")
DEMO = REPO / "demo" / "checkpoints"
Timing = tuple[float, float]  # (seconds to the first sign of life, seconds to the picture)


def openai_plain(client: openai.OpenAI, n: int = 1) -> Timing:
    start = time.perf_counter()
    client.images.generate(model="neopp_dense", prompt=PROMPT, n=n, extra_body={"seed": 1})
    done = time.perf_counter() - start
    return done, done


def openai_streamed(client: openai.OpenAI) -> Timing:
    start, first = time.perf_counter(), None
    for event in client.images.generate(model="neopp_dense", prompt=PROMPT, stream=True, partial_images=3,
                                        extra_body={"seed": 1}):
        first = first if first is not None else time.perf_counter() - start
        if event.type == "image_generation.completed":
            return first, time.perf_counter() - start
    raise RuntimeError("the stream ended without image_generation.completed")


def grpc_progress(client: grpcclient.InferenceServerClient) -> Timing:
    start = time.perf_counter()
    prompt = grpcclient.InferInput("PROMPT", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
    encoded = client.infer("neopp_prompt_encoder", [prompt])
    inputs = []
    for name in (*ENCODER_OUTPUTS, "SEED"):
        array = encoded.as_numpy(name) if name != "SEED" else np.array([1], np.int64)
        inputs.append(grpcclient.InferInput(name, list(array.shape), "BF16" if name.endswith("_KV") else "INT64"))
        inputs[-1].set_data_from_numpy(array)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer("neopp_dense_stream", inputs)
        first = None
        while True:
            result, error = answers.get(timeout=600)
            if error is not None:
                raise error
            first = first if first is not None else time.perf_counter() - start
            if result.as_numpy("IMAGE") is not None:
                return first, time.perf_counter() - start
    finally:
        client.stop_stream()


def serve(workdir: Path) -> Launched:
    env = {"NEOPP_CHECKPOINT": str(DEMO / "dense"), "NEOPP_LORA_DIR": str(DEMO / "lora")}
    launched = launch(workdir / "launcher.log", env, MODELS,
                      launcher_args=["--admin-key-file", str(workdir / "admin.key")])
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{launched.grpc_port}")
    deadline = time.monotonic() + 300
    while True:
        try:
            if all(client.is_model_ready(m) for m in MODELS):
                break
        except Exception:  # noqa: BLE001 - still starting
            pass
        if launched.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start:\n{launched.text()[-3000:]}")
        time.sleep(0.5)
    client.close()
    return launched


def run(args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        launched = serve(Path(tmp))
        try:
            door = openai.OpenAI(base_url=f"http://127.0.0.1:{launched.http_port}/v1", api_key="loopback",
                                 max_retries=0, timeout=600)
            grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{launched.grpc_port}")
            paths: dict[str, Callable[[], Timing]] = {
                "OpenAI API, plain (one answer)": lambda: openai_plain(door),
                "OpenAI API, plain, n=2 (two pictures in one answer)": lambda: openai_plain(door, 2),
                "OpenAI API, stream with partial_images=3": lambda: openai_streamed(door),
                "gRPC: prompt encoder, then the streamed twin (prompt_t2i.py)": lambda: grpc_progress(grpc)}
            for call in paths.values():  # one unmeasured round: connections, first allocations
                call()
            got: dict[str, list[Timing]] = {name: [] for name in paths}
            for _ in range(args.repeats):
                for name, call in paths.items():
                    got[name].append(call())
            grpc.close()
        finally:
            launched.stop()
    rows = ["| path | first sign of life s, median (min-max) | picture s, median (min-max) |", "|---|---|---|"]
    for name, timings in got.items():
        first, picture = stats([t[0] for t in timings]), stats([t[1] for t in timings])
        rows.append(f"| {name} | {first[0]:.2f} ({first[1]:.2f}-{first[2]:.2f}) | "
                    f"{picture[0]:.2f} ({picture[1]:.2f}-{picture[2]:.2f}) |")
    one, two = (stats([t[1] for t in got[name]])[0] for name in list(got)[:2])
    return ("The demo model at its defaults (256x256, 50 steps, guidance 4), the prompt "
            f"\"{PROMPT}\", {args.repeats} interleaved rounds after one unmeasured round. The first sign of "
            "life is the first partial image (OpenAI stream), the first step event (gRPC), or the picture "
            "itself (plain).\n\n" + "\n".join(rows) +
            f"\n\n* Two pictures in one request against one, plain, medians: {two / one:.2f}x (goal <= 1.4x).")


def main(argv: list[str] | None = None) -> Path:
    return section_main(argv, __doc__, "prompt_path.md", "A prompt to a picture: first sign of life and picture",
                        run, repeats=5)


if __name__ == "__main__":
    main()
