"""What a picture's record and its C2PA signature cost next to the request that draws it.

    python -m bench.provenance [--out bench] [--rounds 9] [--steps 50]

The demo checkpoint draws its sample prompt at 256x256 in this process (the mode's pipeline,
``--steps`` steps, guided); its pixels are then encoded ``--rounds`` times each way, the ways
alternating within a round: plain (the marking only), with the record, and with the record and a
signed C2PA manifest (a test CA's ES256 leaf). Printed per format is the median time of each
and what the record and the signature add, as a share of the whole request (the draw plus the
plain encoding). Also printed: the bytes each adds, and the checkpoint hash's speed (paid once
per file and machine, at load).
"""

from __future__ import annotations

import hashlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import REPO, load_note, section_main
from bench.gguf_weights import demo_request
from neopp.image_io import encode_image
from neopp.modes import load_mode
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.sampler import to_pixels
from neopp.serving.c2pa_signing import PictureSigner
from neopp.serving.picture_records import RecordedInputs, RecordSource, request_record
from testing.c2pa_pki import write_test_pki

DEMO = REPO / "demo" / "checkpoints" / "dense"
FORMATS = ("png", "jpeg", "webp")


def seconds(fn, *args) -> float:  # noqa: ANN001 - any call and its arguments
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def body(args) -> str:  # noqa: ANN001 - the section's parsed flags
    torch.manual_seed(0)
    mode = load_mode(REPO / "configs" / "neopp" / "neopp_dense.json")
    pipe = NeoPPPipeline.from_pretrained(DEMO, mode, "cpu", torch.float32)
    req = demo_request(args.steps)
    draws = [seconds(lambda: to_pixels(pipe.sample(req))) for _ in range(3)]
    pixels = to_pixels(pipe.sample(req))
    source = RecordSource("neopp_dense", mode.name, "dense", "0" * 64)
    record = request_record(source, req, 7, None, RecordedInputs("a red circle on the left on a blue background"))
    with tempfile.TemporaryDirectory() as folder:
        pki = write_test_pki(Path(folder))
        signer = PictureSigner(pki["chain"], pki["key"])
        ways = {"plain": lambda f: encode_image(pixels, f),
                "record": lambda f: encode_image(pixels, f, record=record),
                "record + C2PA": lambda f: signer.sign(encode_image(pixels, f, record=record), f, record)}
        rows = [f"| format | {' | '.join(ways)} | record adds | record + C2PA add | bytes added (record, C2PA) |",
                "|---|---|---|---|---|---|---|"]
        request_s = statistics.median(draws)
        for fmt in FORMATS:
            times: dict[str, list[float]] = {way: [] for way in ways}
            for r in range(args.rounds):
                order = list(ways) if r % 2 == 0 else list(reversed(ways))
                for way in order:
                    times[way].append(seconds(ways[way], fmt))
            median = {way: statistics.median(t) for way, t in times.items()}
            whole = request_s + median["plain"]
            sizes = {way: len(fn(fmt)) for way, fn in ways.items()}
            rows.append(f"| {fmt} | " + " | ".join(f"{median[w] * 1e3:.1f} ms" for w in ways)
                        + f" | {(median['record'] - median['plain']) / whole:+.2%} "
                        f"| {(median['record + C2PA'] - median['plain']) / whole:+.2%} "
                        f"| {sizes['record'] - sizes['plain']} B, {sizes['record + C2PA'] - sizes['record']} B |")
    return "\n".join([
        f"The request: the demo's sample prompt, 256x256, {args.steps} steps, guided, drawn in this process in "
        f"{request_s * 1e3:.0f} ms (median of {len(draws)}); each encoding the median of {args.rounds} alternating "
        "rounds. The shares are of the whole request (the draw plus the plain encoding).", "", *rows, "",
        hash_line(), "", load_note()])


def hash_line() -> str:
    """The speed of the checkpoint hash on this machine (SHA-256 over 256 MiB in memory)."""
    data = b"\0" * (256 << 20)
    took = seconds(lambda: hashlib.sha256(data).hexdigest())
    rate = len(data) / took / 1e9
    return (f"The checkpoint's content hash runs at {rate:.2f} GB/s here (SHA-256, from memory): about "
            f"{36 / rate:.0f} s for the 36 GB of an 8B checkpoint, paid once per file and machine (then cached), "
            "plus the time to read the files.")


def main(argv: list[str] | None = None) -> int:
    section_main(argv, __doc__, "provenance.md", "Provenance: the record and the C2PA signature", body,
                 rounds=9, steps=50)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
