"""The door's answers that are not a route's own: JSON errors, and an answer sent before its
request body is drained."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import Response

from . import strict_json


def json_response(status: int, doc: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(strict_json.dumps(doc), status, headers, media_type="application/json")


class AnswerFirst(Response):
    """A whole answer sent before ``after`` runs, the exchange closed only then: a refused body is
    drained while its client already holds the answer."""

    def __init__(self, answer: Response, after: Callable[[], Awaitable[None]]) -> None:
        super().__init__(answer.body, answer.status_code, media_type=answer.media_type)
        self.raw_headers, self.after = answer.raw_headers, after

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": True})
        await self.after()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def error_answer(status: int, doc: Any, headers: dict[str, str] | None,
                 after: Callable[[], Awaitable[None]] | None) -> Response:
    """A JSON error; answered first and drained after when ``after`` is given."""
    response = json_response(status, doc, headers)
    return AnswerFirst(response, after) if after is not None else response
