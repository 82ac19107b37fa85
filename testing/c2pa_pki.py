"""A local certificate authority and a leaf that C2PA signs with, made for the tests (ES256).

C2PA takes a claim signer whose certificate has the digitalSignature key usage, an extended key
usage it accepts (emailProtection here) and an authority key identifier; ``leaf_usages=False``
leaves those out, for the refusal at load. Files are written into ``folder``: ``ca.pem`` (the
trust anchor a reader is given), ``chain.pem`` (leaf then CA) and ``key.pem`` (PKCS#8).
"""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _usage(sign: bool, certs: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=sign, content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=False, key_cert_sign=certs, crl_sign=certs,
                         encipher_only=False, decipher_only=False)


def write_test_pki(folder: Path, leaf_usages: bool = True) -> dict[str, Path]:
    """The CA, the chain and the leaf's key as PEM files in ``folder``."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "neopp test root")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(_usage(True, True), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "neopp test signer")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30)))
    if leaf_usages:
        leaf = (leaf.add_extension(_usage(True, False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.EMAIL_PROTECTION]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                               critical=False))
    leaf = leaf.sign(ca_key, hashes.SHA256())
    pem = serialization.Encoding.PEM
    folder.mkdir(parents=True, exist_ok=True)
    files = {"ca": folder / "ca.pem", "chain": folder / "chain.pem", "key": folder / "key.pem"}
    files["ca"].write_bytes(ca.public_bytes(pem))
    files["chain"].write_bytes(leaf.public_bytes(pem) + ca.public_bytes(pem))
    files["key"].write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return files


def validation_state(data: bytes, mime: str, ca: Path) -> tuple[str, dict]:
    """c2pa-python's reader on ``data``, the test CA its trust anchor: (state, active manifest)."""
    import io

    import c2pa

    context = c2pa.Context.from_dict({"trust": {"trust_anchors": ca.read_text()}})
    with c2pa.Reader(mime, io.BytesIO(data), context=context) as reader:
        return reader.get_validation_state(), reader.get_active_manifest()
