"""Writes docs/openapi.md: ``python -m neopp.launcher.door.openapi_page > docs/openapi.md``.

Apart from ``openapi`` because it builds a whole door (its routes import ``openapi``)."""

from __future__ import annotations

from ...ports import LOOPBACK
from .openapi import document, markdown
from .routes import build_app
from .server import DoorServer


def main() -> None:
    """Print the docs page of the door's routes, read from a door's own route table."""
    server = DoorServer(LOOPBACK, 0, f"{LOOPBACK}:1", (LOOPBACK, 1), "docs", parse_workers=0)
    try:
        print(markdown(document(build_app(server.door).routes)), end="")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
