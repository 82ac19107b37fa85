"""JSON read one way only: duplicate keys, NaN/Infinity and deep nesting are refused, not resolved.

Two parsers that disagree on ``{"shape": [10**12], "shape": [1]}`` let a request pass one check
and mean something else further on; the door parses once with these rules and forwards what it built.
What Python's reader would turn into an error later, or into a value nothing downstream can hold,
is refused here with the rule named: an integer of more digits than any tensor type holds, a
number beyond a 64-bit float (``1e999`` reads as infinity), a lone UTF-16 surrogate (``"\\ud800"``
reads as a string that cannot be written back as UTF-8).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from .door_error import DoorError, invalid

MAX_DEPTH = 32
MAX_INT_DIGITS = 40  # UINT64's maximum has 20; Python refuses to read beyond 4300 digits
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how a lone surrogate can appear in UTF-8 text


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise invalid(f"duplicate key '{key[:64]}' in the JSON body")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise invalid(f"'{name}' is not JSON")


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise invalid(f"an integer of {len(text)} digits is longer than the {MAX_INT_DIGITS} digits any value may have")
    return int(text)


def _number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise invalid(f"the number {text[:40]} is beyond the range of a 64-bit float")
    return value


def _walk(value: Any, check_strings: bool) -> int:
    """Nesting depth, counted without recursion; with ``check_strings`` every key and string is
    also checked for a lone surrogate."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, str):
            if check_strings:
                _unicode(item)
        elif isinstance(item, dict | list):
            deepest = max(deepest, depth)
            children = [*item.values(), *item] if isinstance(item, dict) else item
            todo.extend((child, depth + 1) for child in children if isinstance(child, dict | list | str))
    return deepest


def _unicode(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = text[:16].encode("utf-8", "backslashreplace").decode()
        raise invalid(f"the string '{shown}' holds a lone UTF-16 surrogate; JSON text must be valid Unicode") from None


def loads(body: bytes, what: str = "request body", max_depth: int = MAX_DEPTH) -> Any:
    """The parsed document; a 400 naming the fault otherwise."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid(f"the {what} is not UTF-8") from None
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant,
                           parse_int=_integer, parse_float=_number)
    except RecursionError:
        raise invalid(f"the {what} nests deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise invalid(f"the {what} is not valid JSON: {exc.msg} at position {exc.pos}") from None
    if _walk(value, SURROGATE_ESCAPE.search(text) is not None) > max_depth:
        raise invalid(f"the {what} nests deeper than {max_depth} levels")
    return value


def count_values(body: bytes | bytearray | memoryview, limit: int, what: str, hint: str = "") -> None:
    """A 413 when ``body`` may hold more than ``limit`` JSON values (``ValueCounter`` at once)."""
    ValueCounter(limit, what, hint).feed(body, 0)


class ValueCounter:
    """Counts, as a body arrives, the JSON values in its first ``prefix`` bytes (the JSON part):
    every value after the first is preceded by a comma or a colon, so their count bounds the values
    (strings may hold some). Past ``limit``: a 413 at once, before the rest is read or parsed."""

    def __init__(self, limit: int, what: str, hint: str = "", prefix: int | None = None) -> None:
        self.limit, self.what, self.hint, self.prefix, self.count = limit, what, hint, prefix, 0

    def feed(self, data: bytes | bytearray | memoryview, at: int) -> None:
        """``data`` is the body's bytes from offset ``at``."""
        end = len(data) if self.prefix is None else max(0, min(len(data), self.prefix - at))
        if end:
            part = bytes(data[:end]) if isinstance(data, memoryview) else data[:end] if end < len(data) else data
            self.count += part.count(b",") + part.count(b":")
            if self.count > self.limit:
                raise DoorError(413, f"the {self.what} holds over {self.limit} JSON values"
                                f"{'; ' + self.hint if self.hint else ''}", reason="json_too_large")


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
