"""``neopp models`` and ``neopp status``: what the server draws with, and how it is doing.

Both read what the server advertises (the ``neopp`` extension of ``/v1/models``: sizes and step
limits; the ``/status`` page: readiness, load, latency, errors) and say plainly what a server
that predates either does not tell, rather than guessing it.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from .client import CliError, Server, checked

FIRST = ("ready", "in_flight", "queued")  # the columns a person looks at first, when the server sends them
NAME_KEYS = ("model", "name", "id")


def models(server: Server, out: TextIO = sys.stdout, as_json: bool = False) -> int:
    """One line per model the server draws with: its sizes and step limits where advertised."""
    doc = server.json("GET", "/v1/models")
    data = doc.get("data")
    if not isinstance(data, list):
        raise CliError("/v1/models: the answer has no 'data' list")
    if as_json:
        out.write(json.dumps(data, indent=2) + "\n")
        return 0
    if not data:
        out.write("no model is ready to draw on this server\n")
    for entry in data:
        out.write(model_line(entry) + "\n")
    return 0


def model_line(entry: dict[str, Any]) -> str:
    """``id``, then sizes, default size and step range from its ``neopp`` extension, or what is missing."""
    name = str(entry.get("id", "?"))
    ext = entry.get("neopp")
    if not isinstance(ext, dict):
        return f"{name}  (sizes and step limits not advertised by this server)"
    parts = []
    if isinstance(ext.get("sizes"), list):
        parts.append(sizes_text(ext["sizes"], ext.get("size_range")))
    if ext.get("default_size"):
        parts.append(f"default {ext['default_size']}")
    steps = ext.get("steps")
    if isinstance(steps, dict):
        parts.append(f"steps {steps.get('min', '?')}-{steps.get('max', '?')}")
    if ext.get("default_steps") is not None:
        parts.append(f"default steps {ext['default_steps']}")
    if ext.get("untrained_sizes"):
        parts.append("untrained sizes allowed")
    loras = ext.get("loras")
    if isinstance(loras, list) and loras:
        total = ext.get("loras_total")
        more = f" (of {total})" if isinstance(total, int) and total > len(loras) else ""
        parts.append("loras " + ",".join(str(n) for n in loras) + more)
    return f"{name}  " + "; ".join(parts) if parts else f"{name}  (the neopp extension is empty)"


def sizes_text(sizes: list, size_range: Any) -> str:
    """The sizes as a rule when they are every WxH of the advertised range (49 sizes read badly
    as a list), else listed."""
    if isinstance(size_range, dict) and all(isinstance(size_range.get(k), int) and size_range[k] > 0
                                            for k in ("min", "max", "multiple")):
        low, high, step = size_range["min"], size_range["max"], size_range["multiple"]
        sides = range(low, high + 1, step)
        if sorted(map(str, sizes)) == sorted(f"{w}x{h}" for w in sides for h in sides):
            return f"sizes WxH, each side {low}-{high} in steps of {step}"
    return "sizes " + ",".join(str(s) for s in sizes)


def status(server: Server, out: TextIO = sys.stdout, as_json: bool = False) -> int:
    """Per model: ready, in flight, queued, recent latency, errors, restarts (0 once the server
    answered: a model an operator left unloaded is news, not a failure of the command).

    A server without the status page still answers whether it is ready, which is said with what
    is missing."""
    resp = server.open("GET", "/status")
    if resp.status == 404:
        resp.close()
        return _ready_only(server, out)
    doc = checked(resp, "/status")
    if as_json:
        out.write(json.dumps(doc, indent=2) + "\n")
    else:
        out.write(status_table(doc))
    return 0


def _rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-model rows, whether ``models`` is a list of objects or an object keyed by name."""
    rows = doc.get("models", [])
    if isinstance(rows, dict):
        return [{"model": name, **(row if isinstance(row, dict) else {})} for name, row in rows.items()]
    return [row for row in rows if isinstance(row, dict)] if isinstance(rows, list) else []


def status_table(doc: dict[str, Any]) -> str:
    """The server's other top-level facts as ``key: value`` lines, then a table, one model a line,
    a column per field the server sends (ready, in flight and queued first); ``-`` where a row
    lacks one. The columns come from the answer, so a field the page adds shows without a change here."""
    rows = _rows(doc)
    keys = [k for k in FIRST if any(k in row for row in rows)]
    for row in rows:
        keys += [k for k in row if k not in keys and k not in NAME_KEYS]
    lines = [["model", *(k.replace("_", " ") for k in keys)]]
    for row in rows:
        name = next((row[k] for k in NAME_KEYS if k in row), "?")
        lines.append([str(name), *(_cell(row.get(k)) for k in keys)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    facts = "".join(f"{k.replace('_', ' ')}: {_cell(v)}\n" for k, v in doc.items() if k != "models")
    table = "".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() + "\n" for line in lines)
    return facts + (table if rows else "(the server lists no models)\n")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.0f}"
    if isinstance(value, dict):  # e.g. latency percentiles
        return " ".join(f"{k}={_cell(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ",".join(_cell(v) for v in value)
    return str(value).replace("\n", " ")


def _ready_only(server: Server, out: TextIO) -> int:
    """What a server without ``/status`` tells: overall readiness and the models that draw."""
    resp = server.open("GET", "/v2/health/ready")
    ready = resp.status == 200
    resp.close()
    out.write(f"{server.url} has no /status page (a server older than it): in flight, queue, latency, errors "
              f"and restarts are on its /metrics only\nserver ready: {'yes' if ready else 'no'}\n")
    try:
        names = [str(m.get("id")) for m in server.json("GET", "/v1/models").get("data", [])]
    except CliError as exc:
        out.write(f"models: unknown ({exc})\n")
        return 1
    out.write("ready to draw: " + (", ".join(names) if names else "none") + "\n")
    return 0

