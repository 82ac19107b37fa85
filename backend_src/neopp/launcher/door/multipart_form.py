"""A ``multipart/form-data`` body (RFC 7578) read once, strictly and within bounds.

The door reads the whole body under its caps first; this splits it into parts without copying
their contents (each is a view of the body). Only what the form needs is accepted: the boundary
named by Content-Type, a body that starts at its first delimiter and ends at the closing one
(a trailing CRLF aside), part headers of bounded size and number, and a Content-Disposition of
``form-data`` with a name on every part. A file part need not carry a filename: clients that
send bytes without a name (as OpenAI's SDK may) are answered like any other.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

MAX_PART_HEADER = 8 * 1024  # the header block of one part: a name, a filename, a type
MAX_PART_HEADER_LINES = 8
MAX_NAME = 128  # a field's name; the form's own names are far shorter
# RFC 2046: 1 to 70 characters of a restricted set, not ending in a space
BOUNDARY = re.compile(r"^[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]$")
PARAMETER = re.compile(r';\s*([A-Za-z0-9_.*-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;\s"]*)\s*')
CRLF = b"\r\n"


class FormError(ValueError):
    """A body that is not the form it claims to be; ``field`` names the part at fault, if any."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Part:
    """One field of the form: its name, the filename it was sent with (None: none), and its bytes."""

    name: str
    filename: str | None
    content_type: str | None
    data: memoryview


def media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def boundary_of(content_type: str) -> bytes:
    """The boundary a ``multipart/form-data`` Content-Type names; anything else is refused."""
    if media_type(content_type) != "multipart/form-data":
        shown = media_type(content_type)[:64] or "none"
        raise FormError(f"the body must be multipart/form-data (the pictures as files, the other fields as text); "
                        f"the Content-Type is {shown}")
    params = _parameters(content_type[content_type.index(";"):] if ";" in content_type else "")
    value = params.get("boundary")
    if value is None or not BOUNDARY.match(value):
        raise FormError("the multipart/form-data Content-Type must name its boundary "
                        "(boundary=..., 1 to 70 characters as RFC 2046 allows)")
    return value.encode("ascii")


def parts(data: bytes | bytearray, boundary: bytes) -> Iterator[Part]:
    """The parts of ``data`` in order, each checked as it is reached (a caller that refuses one
    stops reading there). Every byte is scanned once: the work is bounded by the body's size."""
    view = memoryview(data)
    delimiter = b"--" + boundary
    if not data.startswith(delimiter):
        raise FormError("the multipart body must start with its boundary ('--' and the boundary)")
    at = len(delimiter)
    while True:
        if data[at:at + 2] == b"--":  # the closing delimiter
            if data[at + 2:] not in (b"", CRLF):
                raise FormError("the multipart body has bytes after its closing boundary")
            return
        if data[at:at + 2] != CRLF:
            raise FormError("a multipart boundary must be followed by CRLF or '--'"
                            if at + 2 <= len(data) else _truncated())
        name, filename, content_type, start = _head(data, at + 2)
        end = data.find(CRLF + delimiter, start)
        if end < 0:
            raise FormError(_truncated(), name)
        yield Part(name, filename, content_type, view[start:end])
        at = end + len(CRLF) + len(delimiter)


def _truncated() -> str:
    return "the multipart body ends before its closing boundary (is it truncated?)"


def _head(data: bytes | bytearray, at: int) -> tuple[str, str | None, str | None, int]:
    """A part's name, filename and Content-Type, and where its contents start."""
    if data[at:at + 2] == CRLF:  # no header at all
        _disposition(None)
    end = data.find(CRLF + CRLF, at, at + MAX_PART_HEADER + 4)
    if end < 0:
        if len(data) - at <= MAX_PART_HEADER:
            raise FormError(_truncated())
        raise FormError(f"a multipart part's headers are over {MAX_PART_HEADER} bytes")
    lines = bytes(data[at:end]).split(CRLF)
    if len(lines) > MAX_PART_HEADER_LINES:
        raise FormError(f"a multipart part has more than {MAX_PART_HEADER_LINES} header lines")
    headers: dict[str, str] = {}
    for line in lines:
        key, colon, value = line.partition(b":")
        if not colon or not key.strip() or key != key.strip():
            raise FormError("a multipart part header must be 'Name: value'")
        try:
            text = value.strip().decode("utf-8")
        except UnicodeDecodeError:
            raise FormError("a multipart part header is not UTF-8") from None
        name = key.decode("latin-1").lower()
        if name in headers:
            raise FormError(f"a multipart part names its {name} twice")
        headers[name] = text
    name, filename = _disposition(headers.get("content-disposition"))
    return name, filename, headers.get("content-type"), end + 4


def _disposition(value: str | None) -> tuple[str, str | None]:
    """``form-data; name="..."[; filename="..."]``: the field's name and the file's, if any."""
    kind = (value or "").split(";", 1)[0].strip().lower()
    if kind != "form-data":
        raise FormError("every multipart part needs 'Content-Disposition: form-data; name=\"...\"'")
    params = _parameters(value[value.index(";"):] if value and ";" in value else "")
    name = params.get("name")
    if not name or len(name) > MAX_NAME:
        raise FormError(f"a multipart part's Content-Disposition must name its field (at most {MAX_NAME} characters)")
    return name, params.get("filename")


def _parameters(text: str) -> dict[str, str]:
    """``; key=value`` pairs (values quoted or not); text that is not such pairs is refused."""
    found: dict[str, str] = {}
    at = 0
    while at < len(text):
        match = PARAMETER.match(text, at)
        if match is None:
            raise FormError(f"a multipart header's parameters are malformed near {text[at:at + 32]!r}")
        key, raw = match.group(1).lower(), match.group(2)
        if key in found:
            raise FormError(f"a multipart header names its {key!r} parameter twice")
        found[key] = re.sub(r"\\(.)", r"\1", raw[1:-1]) if raw.startswith('"') else raw
        at = match.end()
    return found
