"""JSON read one way only: duplicate keys, NaN/Infinity and deep nesting are refused, not resolved.

Two parsers that disagree on ``{"shape": [10**12], "shape": [1]}`` let a request pass one check
and mean something else further on; the door parses once with these rules and forwards what it built.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import invalid

MAX_DEPTH = 32


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise invalid(f"duplicate key '{key[:64]}' in the JSON body")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise invalid(f"'{name}' is not JSON")


def _depth(value: Any) -> int:
    """Nesting depth, counted without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)
                        if isinstance(child, dict | list))
    return deepest


def loads(body: bytes, what: str = "request body", max_depth: int = MAX_DEPTH) -> Any:
    """The parsed document; a 400 naming the fault otherwise."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid(f"the {what} is not UTF-8") from None
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except RecursionError:
        raise invalid(f"the {what} nests deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise invalid(f"the {what} is not valid JSON: {exc.msg} at position {exc.pos}") from None
    if _depth(value) > max_depth:
        raise invalid(f"the {what} nests deeper than {max_depth} levels")
    return value


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
