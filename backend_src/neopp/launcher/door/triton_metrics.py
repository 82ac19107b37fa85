"""Triton's metrics port, read by the door: the models' counters for ``/status`` and the facts
each generation model publishes (``neopp_model_capabilities``) for ``/v1/models``. An answer is
read to its end (it arrives in pieces: one read once gave a third of it) or not used at all."""

from __future__ import annotations

import asyncio
import re

from ...contract.published_facts import CAPABILITIES_METRIC

MODEL_LABEL = r'model="([A-Za-z0-9_.-]{1,128})"'
SAMPLE = re.compile(r'^([a-z_]+)\{[^}]*' + MODEL_LABEL + r'[^}]*\} ([0-9.eE+-]+)$')
CAPABILITIES = re.compile(rf'^{CAPABILITIES_METRIC}\{{(.*)\}} 1(?:\.0*)?$')
LABEL = re.compile(r'([a-z_]+)="((?:[^"\\]|\\.)*)"')
MAX_METRICS = 4 << 20  # Triton's exposition for a few dozen models is tens of kilobytes
TIMEOUT_S = 5.0


async def fetch(address: tuple[str, int] | None) -> str:
    """The metrics text ("" when there is no metrics port or it does not answer)."""
    if address is None:
        return ""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        return ""
    try:
        writer.write(f"GET /metrics HTTP/1.0\r\nHost: {address[0]}\r\n\r\n".encode())
        raw = await asyncio.wait_for(read_to_end(reader), TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        return ""
    finally:
        writer.close()
    return complete_body(raw) if raw is not None else ""


async def read_to_end(reader: asyncio.StreamReader) -> bytes | None:
    """Everything until the server closes (HTTP/1.0): an answer comes in as many pieces as the
    network makes of it. None past MAX_METRICS."""
    parts, size = [], 0
    while chunk := await reader.read(1 << 16):
        size += len(chunk)
        if size > MAX_METRICS:
            return None
        parts.append(chunk)
    return b"".join(parts)


def complete_body(raw: bytes) -> str:
    """The body of a whole 200 answer; "" for any other answer, or one shorter than its Content-Length."""
    head, _, body = raw.partition(b"\r\n\r\n")
    if not (head.startswith(b"HTTP/1.") and b" 200 " in head[:16]):
        return ""
    length = re.search(rb"(?im)^content-length:[ \t]*([0-9]{1,12})[ \t]*$", head)
    if length is not None and len(body) != int(length.group(1)):
        return ""
    return body.decode("utf-8", "replace")


def samples(text: str, wanted: dict[str, str]) -> dict[str, dict[str, float]]:
    """{model: {field: value}} of the ``wanted`` series (name -> field), summed over other labels."""
    found: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match and match.group(1) in wanted:
            fields = found.setdefault(match.group(2), {})
            key = wanted[match.group(1)]
            fields[key] = fields.get(key, 0.0) + float(match.group(3))
    return found


def by_label(text: str, name: str, label: str) -> dict[str, dict[str, float]]:
    """{model: {value of ``label``: value}} of the series ``name``."""
    found: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match and match.group(1) == name:
            labels = dict(LABEL.findall(line[len(name) + 1:line.rindex("}")]))
            if label in labels:
                values = found.setdefault(match.group(2), {})
                values[labels[label]] = values.get(labels[label], 0.0) + float(match.group(3))
    return found


def capabilities(text: str) -> dict[str, str]:
    """{model: the JSON text of its published facts}."""
    found = {}
    for line in text.splitlines():
        match = CAPABILITIES.match(line)
        if match:
            labels = {k: _unescaped(v) for k, v in LABEL.findall(match.group(1))}
            if "model" in labels and "capabilities" in labels:
                found[labels["model"]] = labels["capabilities"]
    return found


def _unescaped(value: str) -> str:
    """A label value as Prometheus escapes it (backslash, quote, newline)."""
    return re.sub(r'\\(.)', lambda m: "\n" if m.group(1) == "n" else m.group(1), value)
