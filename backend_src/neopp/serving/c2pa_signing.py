"""A signed C2PA manifest in each final picture, when the operator gives a certificate and key.

The manifest says who made the picture and how: a ``c2pa.created`` action with the digital
source type ``trainedAlgorithmicMedia`` and this server as its software agent, and the
picture's record (:mod:`neopp.contract.picture_record`), as its JSON text, in the
``org.neopp.parameters`` assertion (``{"record": "<JSON>"}``). It is made with the
``c2pa-python`` library, whose reader validates it. The certificate and key are files the
model's config names (``c2pa_certificate``, ``c2pa_key``, or env ``NEOPP_C2PA_CERTIFICATE`` /
``NEOPP_C2PA_KEY``), never anything a request says; a pair that does not load stops the model
from loading, with the reason. Previews are never signed. No timestamp authority is asked
(nothing leaves the machine), and no thumbnail is embedded (the library's default would add a
1024-pixel copy of the picture to every file).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import ConfigError
from ..image_metadata import DIGITAL_SOURCE_TYPE

PARAMETERS_LABEL = "org.neopp.parameters"
MIME_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
MAX_PEM_BYTES = 1 << 20
_CURVE_ALGORITHMS = {"secp256r1": "ES256", "secp384r1": "ES384", "secp521r1": "ES512"}


def manifest(record: str | None) -> dict[str, Any]:
    """The manifest of one picture: who made it, that a model did, and with what parameters."""
    assertions: list[dict[str, Any]] = [{"label": "c2pa.actions", "data": {"actions": [{
        "action": "c2pa.created", "digitalSourceType": DIGITAL_SOURCE_TYPE,
        "softwareAgent": {"name": "neopp", "version": __version__}}]}}]
    if record is not None:
        # the record as its JSON text: the library stores a list of numbers as a byte string, which
        # would lose the guidance interval
        assertions.append({"label": PARAMETERS_LABEL, "data": {"record": record}})
    return {"claim_generator_info": [{"name": "neopp", "version": __version__}], "assertions": assertions}


class PictureSigner:
    """One loaded certificate and key, shared by the model's threads (the library allows it)."""

    def __init__(self, certificate: Path, key: Path) -> None:
        try:
            import c2pa
        except ImportError as exc:
            raise ConfigError("c2pa_certificate is set but the c2pa-python package is not installed "
                              "(pip install .[c2pa])") from exc
        chain, key_pem = _pem(certificate, "c2pa_certificate"), _pem(key, "c2pa_key")
        algorithm = _algorithm(key_pem)
        try:
            info = c2pa.C2paSignerInfo(getattr(c2pa.C2paSigningAlg, algorithm), chain, key_pem, None)
            self._signer = c2pa.Signer.from_info(info)
            self._context = c2pa.Context.from_dict({"builder": {"thumbnail": {"enabled": False}}})
            self.sign(_probe_png(), "png", None)  # a certificate C2PA refuses stops the load, not a request
        except c2pa.C2paError as exc:
            raise ConfigError(f"c2pa_certificate / c2pa_key: C2PA refuses them: {exc}") from exc
        self.algorithm = algorithm

    def sign(self, data: bytes, fmt: str, record: str | None) -> bytes:
        """``data`` (an encoded picture of ``fmt``) with its manifest embedded."""
        import c2pa

        out = io.BytesIO()
        with c2pa.Builder(manifest(record), context=self._context) as builder:
            builder.sign(self._signer, MIME_TYPES[fmt], io.BytesIO(data), out)
        return out.getvalue()


def picture_signer(certificate: Path | None, key: Path | None) -> PictureSigner | None:
    """The model's signer, or None when no certificate is configured (nothing is signed)."""
    if certificate is None and key is None:
        return None
    if certificate is None or key is None:
        missing = "c2pa_key" if key is None else "c2pa_certificate"
        raise ConfigError(f"{missing}: required together with "
                          f"{'c2pa_certificate' if key is None else 'c2pa_key'} to sign pictures")
    return PictureSigner(certificate, key)


def _pem(path: Path, parameter: str) -> bytes:
    try:
        size = path.stat().st_size
        if size > MAX_PEM_BYTES:
            raise ConfigError(f"{parameter}: {path} holds {size} bytes, more than a PEM file of "
                              f"{MAX_PEM_BYTES} should")
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{parameter}: cannot read {path} ({exc.strerror or exc})") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{parameter}: {path} is not a PEM file")
    return data


def _algorithm(key_pem: bytes) -> str:
    """The C2PA signing algorithm of the key's type: ES256/384/512 for EC keys, Ed25519, PS256 for RSA."""
    try:
        from cryptography.exceptions import UnsupportedAlgorithm
        from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
        from cryptography.hazmat.primitives.serialization import load_pem_private_key
    except ImportError as exc:
        raise ConfigError("c2pa_key: reading the key needs the cryptography package (pip install .[c2pa])") from exc
    try:
        key = load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"c2pa_key: not an unencrypted PEM private key ({exc})") from None
    if isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name in _CURVE_ALGORITHMS:
        return _CURVE_ALGORITHMS[key.curve.name]
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return "ED25519"
    if isinstance(key, rsa.RSAPrivateKey):
        return "PS256"
    raise ConfigError(f"c2pa_key: a {type(key).__name__} key; C2PA signs with EC P-256/384/521, Ed25519 or RSA")


def _probe_png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    return buf.getvalue()
