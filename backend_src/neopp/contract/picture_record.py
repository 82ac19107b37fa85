"""How a picture was made, as the small JSON record its file carries, and reading it back.

The record is what redraws the picture: the model and its mode, the checkpoint's name and
content hash, the size, the sampling values, the seed (``"stream"`` when the noise continued a
stream, ``"noise"`` when the client sent the starting state itself), the adapter, the step
cache, think mode and this server's version; the prompts only where the operator allows
(``record_prompt``). PNG holds it in an ``iTXt`` chunk named ``RECORD_KEY``, JPEG and WebP in
their XMP packet (:mod:`neopp.image_metadata`).

Reading is strict, and on a client's file, with the standard library alone: the file's chunks
or segments are walked up to its pixels (where this server writes the record), nothing is
decoded, and the record must be one JSON object of at most
``MAX_RECORD_BYTES`` with known keys of the right types, else it is refused in words.
"""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from typing import Any


class RecordError(ValueError):
    """A picture whose record cannot be read, in words a person acts on."""

RECORD_KEY = "neopp.record"  # the PNG iTXt keyword
RECORD_VERSION = 1
MAX_RECORD_BYTES = 96 * 1024  # two prompts at their bound, and the rest
MAX_PICTURE_BYTES = 64 * 1024 * 1024  # a file read for its record
SEED_WORDS = ("stream", "noise")  # a seed that cannot redraw: a continued stream, a client's noise

# key -> the types its value may take (None: JSON null)
_FIELDS: dict[str, tuple[type | None, ...]] = {
    "record": (int,), "software": (str,), "model": (str,), "mode": (str,),
    "checkpoint": (str,), "checkpoint_sha256": (str,), "width": (int,), "height": (int,), "resize": (list, None),
    "steps": (int,), "guidance_scale": (float,), "guidance_interval": (list,), "guidance_norm": (str,),
    "image_guidance_scale": (float, None), "timestep_shift": (float,), "seed": (int, str),
    "lora": (str, None), "lora_scale": (float, None), "cache": (str,), "cache_threshold": (float, None),
    "think": (bool,), "think_max_tokens": (int, None), "edit": (bool,),
    "prompt": (str, None), "negative_prompt": (str, None), "prompts_omitted": (bool,),
}
REQUIRED = ("record", "model", "mode", "width", "height", "steps", "guidance_scale", "timestep_shift", "seed")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
XMP_JPEG_SIGNATURE = b"http://ns.adobe.com/xap/1.0/\0"
_XMP_RECORD = re.compile(r'\sneopp:Record="([^"]*)"')
_XML_ESCAPES = (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ('"', "&quot;"), ("\n", "&#10;"), ("\r", "&#13;"),
                ("\t", "&#9;"))


def record_text(record: dict[str, Any]) -> str:
    """The record as the file holds it: compact JSON, keys in the writer's order, UTF-8 kept."""
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def xml_attribute(text: str) -> str:
    """``text`` escaped for a double-quoted XML attribute."""
    for raw, escaped in _XML_ESCAPES:
        text = text.replace(raw, escaped)
    return text


def _xml_unescaped(text: str) -> str:
    for raw, escaped in reversed(_XML_ESCAPES):
        text = text.replace(escaped, raw)
    return text


def read_record(data: bytes) -> dict[str, Any]:
    """The record of a picture file's bytes (PNG, JPEG or WebP), checked; refused in words when
    the file is not one of those, holds no record, or holds a damaged one."""
    if len(data) > MAX_PICTURE_BYTES:
        raise RecordError(f"picture: {len(data)} bytes, over the {MAX_PICTURE_BYTES} a file read for its "
                          "record may hold")
    if data.startswith(PNG_SIGNATURE):
        text = _png_record(data)
    elif data.startswith(b"\xff\xd8"):
        text = _from_xmp(_jpeg_xmp(data))
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        text = _from_xmp(_webp_xmp(data))
    else:
        raise RecordError("picture: not a PNG, JPEG or WebP file")
    if text is None:
        raise RecordError("picture: it holds no NeoPP record (was it made by this server, and kept as it was sent?)")
    return parse_record(text)


def _png_record(data: bytes) -> str | None:
    """The text of the ``neopp.record`` iTXt chunk, looked for before the pixels (where it is written)."""
    at = len(PNG_SIGNATURE)
    while at + 12 <= len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        if len(body) < length:
            raise RecordError("picture: the PNG file is cut short")
        if kind in (b"IDAT", b"IEND"):
            return None
        if kind == b"iTXt" and body.startswith(RECORD_KEY.encode() + b"\0"):
            return _itxt_text(body[len(RECORD_KEY) + 1:])
        at += 12 + length
    raise RecordError("picture: the PNG file is cut short")


def _itxt_text(rest: bytes) -> str:
    """An iTXt chunk's text after its keyword: flag, method, language, translated keyword, text."""
    compressed, parts = rest[:1] == b"\1", rest[2:].split(b"\0", 2)
    if len(parts) != 3:
        raise RecordError("picture: its record chunk is damaged")
    text = parts[2]
    if compressed:
        inflater = zlib.decompressobj()
        try:
            text = inflater.decompress(text, MAX_RECORD_BYTES + 1)
        except zlib.error:
            raise RecordError("picture: its record chunk is damaged (bad compression)") from None
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError:
        raise RecordError("picture: its record is not UTF-8 text") from None


def _jpeg_xmp(data: bytes) -> bytes | None:
    """The XMP packet of a JPEG's APP1 segment, looked for up to the start of the scan."""
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            raise RecordError("picture: the JPEG file is damaged")
        marker, length = data[at + 1], struct.unpack(">H", data[at + 2:at + 4])[0]
        if marker in (0xDA, 0xD9):  # the pixels (or the end) begin: no XMP before them
            return None
        segment = data[at + 4:at + 2 + length]
        if marker == 0xE1 and segment.startswith(XMP_JPEG_SIGNATURE):
            return segment[len(XMP_JPEG_SIGNATURE):]
        at += 2 + length
    return None


def _webp_xmp(data: bytes) -> bytes | None:
    """The payload of a WebP's ``XMP `` chunk."""
    at = 12
    while at + 8 <= len(data):
        kind, length = data[at:at + 4], struct.unpack("<I", data[at + 4:at + 8])[0]
        if kind == b"XMP ":
            return data[at + 8:at + 8 + length]
        at += 8 + length + (length & 1)
    return None


def _from_xmp(xmp: bytes | None) -> str | None:
    if xmp is None:
        return None
    found = _XMP_RECORD.findall(xmp.decode("utf-8", "replace"))
    if len(found) > 1:
        raise RecordError("picture: its XMP holds more than one NeoPP record")
    return _xml_unescaped(found[0]) if found else None


def parse_record(text: str) -> dict[str, Any]:
    """A record's JSON text, checked key by key."""
    if len(text.encode("utf-8")) > MAX_RECORD_BYTES:
        raise RecordError(f"picture: its record is over {MAX_RECORD_BYTES} bytes")
    try:
        doc = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise RecordError(f"picture: its record is not valid JSON ({str(exc)[:80]})") from None
    if not isinstance(doc, dict):
        raise RecordError("picture: its record must be a JSON object")
    for key, value in doc.items():
        _check_field(key, value)
    missing = [key for key in REQUIRED if key not in doc]
    if missing:
        raise RecordError(f"picture: its record lacks {missing[0]!r}")
    if doc["record"] != RECORD_VERSION:
        raise RecordError(f"picture: record version {doc['record']} is not one this server reads ({RECORD_VERSION})")
    if isinstance(doc["seed"], str) and doc["seed"] not in SEED_WORDS:
        raise RecordError(f"picture: record 'seed' must be a number or one of {list(SEED_WORDS)}")
    return doc


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value) and abs(value) < 2**63
    except OverflowError:
        return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _check_field(key: str, value: Any) -> None:
    kinds = _FIELDS.get(key)
    if kinds is None:
        raise RecordError(f"picture: its record holds an unknown key {key[:40]!r}")
    if value is None:
        if None not in kinds:
            raise RecordError(f"picture: record {key!r} must not be null")
        return
    if float in kinds and type(value) is int:
        try:
            value = float(value)
        except OverflowError:
            raise RecordError(f"picture: record {key!r} is out of range") from None
    if not any(kind is not None and type(value) is kind for kind in kinds):
        raise RecordError(f"picture: record {key!r} has the wrong type ({type(value).__name__})")
    if isinstance(value, float) and not math.isfinite(value):
        raise RecordError(f"picture: record {key!r} must be finite")
    if isinstance(value, list) and (len(value) != 2 or not all(type(v) in (int, float) and _finite(v)
                                                               for v in value)):
        raise RecordError(f"picture: record {key!r} must hold two finite numbers")
