"""A server whose operator signs pictures and lets records keep prompts: each final picture from
``/v1`` carries a C2PA manifest that c2pa-python's reader validates against the test CA, with the
record (prompts included) as its parameters; previews carry the record and no manifest; a redraw
from the signed file draws the same pixels and record (a signature is new each time: ECDSA draws
a nonce); ``/status`` says the model signs."""

from __future__ import annotations

import base64
import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from neopp.contract.picture_record import read_record
from testing import REPO
from testing.c2pa_pki import validation_state, write_test_pki
from testing.launched import Launched, serving

pytest.importorskip("c2pa")
DEMO = REPO / "demo" / "checkpoints"
MODELS = ("neopp_dense", "neopp_dense_stream", "neopp_prompt_encoder", "neopp_t2i")
PROMPT = "a red circle on the left on a blue background"


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Launched, dict[str, Path]]:
    folder = tmp_path_factory.mktemp("provenance")
    pki = write_test_pki(folder / "pki")
    env = {"NEOPP_CHECKPOINT": str(DEMO / "dense"), "NEOPP_LORA_DIR": str(DEMO / "lora"),
           "NEOPP_C2PA_CERTIFICATE": str(pki["chain"]), "NEOPP_C2PA_KEY": str(pki["key"]),
           "NEOPP_RECORD_PROMPT": "true"}
    with serving(folder / "serve.log", env, MODELS, max_restarts=1) as handle:
        yield handle, pki


def _stream(served: Launched, body: dict) -> list[dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{served.http_port}/v1/images/generations",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=180) as resp:
        blocks = resp.read().decode().split("\n\n")
    datas = ["".join(line[6:] for line in b.split("\n") if line.startswith("data: ")) for b in blocks]
    return [json.loads(d) for d in datas if d and d != "[DONE]"]


def test_final_pictures_are_signed_with_their_record_and_previews_are_not(signed):
    served, pki = signed
    events = _stream(served, {"prompt": PROMPT, "size": "128x128", "num_inference_steps": 3, "seed": 4,
                              "negative_prompt": "green", "stream": True, "partial_images": 1,
                              "output_format": "jpeg"})
    previews = [base64.b64decode(e["b64_json"]) for e in events if e["type"] == "image_generation.partial_image"]
    (final,) = [base64.b64decode(e["b64_json"]) for e in events if e["type"] == "image_generation.completed"]
    state, manifest = validation_state(final, "image/jpeg", pki["ca"])
    assert state == "Trusted"
    record = read_record(final)
    assert (record["prompt"], record["negative_prompt"], record["seed"], record["steps"]) == (PROMPT, "green", 4, 3)
    parameters = {a["label"]: a["data"] for a in manifest["assertions"]}["org.neopp.parameters"]
    assert json.loads(parameters["record"]) == record
    assert previews and all(read_record(p) == record for p in previews)
    assert all(b"c2pa" not in p for p in previews)  # no manifest (JUMBF boxes are labelled c2pa)


@pytest.mark.parametrize("fmt", ["png", "webp"])
def test_a_redraw_from_a_signed_picture_draws_its_pixels_and_record_again(signed, fmt, tmp_path):
    served, pki = signed
    body = {"prompt": PROMPT, "size": "128x128", "num_inference_steps": 2, "seed": 8, "output_format": fmt}
    first = _final(served, body)
    record = read_record(first)
    again = _final(served, {**body, "seed": record["seed"], "timestep_shift": record["timestep_shift"]})
    assert validation_state(again, f"image/{fmt}", pki["ca"])[0] == "Trusted"
    assert read_record(again) == record
    assert np.array_equal(_pixels(first), _pixels(again))


def test_status_says_the_model_signs(signed):
    served, _ = signed
    with urllib.request.urlopen(f"http://127.0.0.1:{served.http_port}/status?format=json", timeout=30) as resp:
        models = {m["model"]: m for m in json.load(resp)["models"]}
    assert models["neopp_dense"]["c2pa_signed"] is True and models["neopp_dense_stream"]["c2pa_signed"] is True
    assert models["neopp_t2i"]["c2pa_signed"] is None  # it draws nothing itself


def _final(served: Launched, body: dict) -> bytes:
    request = urllib.request.Request(f"http://127.0.0.1:{served.http_port}/v1/images/generations",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=180) as resp:
        return base64.b64decode(json.load(resp)["data"][0]["b64_json"])


def _pixels(data: bytes) -> np.ndarray:
    import io

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
