"""The signed C2PA manifest: made with c2pa-python from a test CA's leaf, validated by the same
library's reader against that CA (the independent check), in every format; a changed pixel
fails it; a certificate C2PA refuses stops the model at load, in words."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from neopp.contract.picture_record import read_record
from neopp.errors import ConfigError
from neopp.image_io import encode_image
from neopp.image_metadata import DIGITAL_SOURCE_TYPE
from neopp.serving.c2pa_signing import MIME_TYPES, PARAMETERS_LABEL, PictureSigner, picture_signer
from testing.c2pa_pki import validation_state, write_test_pki

pytest.importorskip("c2pa")
PIXELS = np.random.default_rng(2).integers(0, 256, (64, 64, 3), dtype=np.uint8)
RECORD = json.dumps({"record": 1, "model": "neopp_dense", "mode": "neopp_dense", "width": 64, "height": 64,
                     "steps": 2, "guidance_scale": 4.0, "guidance_interval": [-1.0, 2.0], "timestep_shift": 3.0,
                     "seed": 5})


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    return write_test_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def signer(pki) -> PictureSigner:
    return PictureSigner(pki["chain"], pki["key"])


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_a_signed_picture_validates_against_the_ca_and_keeps_its_record_and_marking(signer, pki, fmt):
    plain = encode_image(PIXELS, fmt, record=RECORD)
    signed = signer.sign(plain, fmt, RECORD)
    state, manifest = validation_state(signed, MIME_TYPES[fmt], pki["ca"])
    assert state == "Trusted"
    assertions = {a["label"]: a["data"] for a in manifest["assertions"]}
    (action,) = assertions["c2pa.actions.v2"]["actions"]
    assert action["action"] == "c2pa.created" and action["digitalSourceType"] == DIGITAL_SOURCE_TYPE
    assert action["softwareAgent"]["name"] == "neopp"
    assert json.loads(assertions[PARAMETERS_LABEL]["record"]) == json.loads(RECORD)
    assert read_record(signed) == read_record(plain)  # the record is still where the reader looks


def test_a_changed_pixel_breaks_the_signature(signer, pki):
    signed = bytearray(signer.sign(encode_image(PIXELS, "jpeg", record=RECORD), "jpeg", RECORD))
    signed[-100] ^= 0x01  # inside the scan: the pixels the manifest's hash covers
    state, _ = validation_state(bytes(signed), "image/jpeg", pki["ca"])
    assert state == "Invalid"


def test_without_a_certificate_nothing_is_signed():
    assert picture_signer(None, None) is None


def test_a_certificate_without_its_key_or_a_broken_pair_stops_the_load(pki, tmp_path):
    with pytest.raises(ConfigError, match="c2pa_key: required together with c2pa_certificate"):
        picture_signer(pki["chain"], None)
    (tmp_path / "text.pem").write_text("hello")
    with pytest.raises(ConfigError, match="is not a PEM file"):
        picture_signer(tmp_path / "text.pem", pki["key"])
    with pytest.raises(ConfigError, match="cannot read"):
        picture_signer(tmp_path / "absent.pem", pki["key"])
    with pytest.raises(ConfigError, match="not an unencrypted PEM private key"):
        picture_signer(pki["chain"], pki["chain"])


def test_a_leaf_without_the_usages_c2pa_requires_is_refused_at_load(tmp_path):
    bare = write_test_pki(tmp_path / "bare", leaf_usages=False)
    with pytest.raises(ConfigError, match="C2PA refuses them"):
        picture_signer(bare["chain"], bare["key"])
