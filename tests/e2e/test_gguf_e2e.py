"""A GGUF checkpoint served as `make serve` serves one: the demo checkpoint written as one Q8_0
file (both towers' layer linears quantized) beside its config.json and tokenizer, named by
NEOPP_CHECKPOINT. A prompt through /v1 draws the very PNG that a second launcher draws from the
floats the ``gguf`` package reads out of that file (held as safetensors), and the generation
model keeps its linears as blocks."""

from __future__ import annotations

import base64
import http.client
import json
from pathlib import Path

import pytest

from neopp.ports import LOOPBACK
from testing import REPO
from testing.launched import Launched, serving
from testing.pictures import same_pixels
from testing.tiny_gguf import dequantized_reference, write_gguf

DEMO = REPO / "demo" / "checkpoints" / "dense"
MODELS = ("neopp_dense", "neopp_prompt_encoder", "neopp_t2i")
ASK = {"prompt": "a red circle on the left on a blue background", "seed": 5, "num_inference_steps": 6,
       "size": "192x128"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gguf_e2e")
    file = write_gguf(DEMO, root / "gguf", "Q8_0")
    return file, dequantized_reference(file, root / "reference")


def drawn(served: Launched) -> bytes:
    conn = http.client.HTTPConnection(LOOPBACK, served.http_port, timeout=120)
    try:
        conn.request("POST", "/v1/images/generations", body=json.dumps(ASK),
                     headers={"Content-Type": "application/json"})
        answer = conn.getresponse()
        doc = json.loads(answer.read())
    finally:
        conn.close()
    assert answer.status == 200, doc
    return base64.b64decode(doc["data"][0]["b64_json"])


def test_a_prompt_draws_from_a_gguf_file_what_its_floats_draw(checkpoints, tmp_path):
    file, reference = checkpoints
    pictures = {}
    for name, checkpoint in (("gguf", file), ("floats", reference)):
        with serving(tmp_path / f"{name}.log", {"NEOPP_CHECKPOINT": str(checkpoint)}, MODELS,
                     no_traceback=True) as served:
            pictures[name] = drawn(served)
            log = served.text()
        assert f"loaded {checkpoint}" in log, log[-3000:]
    assert pictures["gguf"][:8] == b"\x89PNG\r\n\x1a\n"
    assert same_pixels(pictures["gguf"], pictures["floats"])  # each record names its own checkpoint
