"""glm-serve's API key check: `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's)."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.applications import Starlette

from glmkit.serve.messages_api import anthropic_error, speaks_anthropic
from glmkit.serve.protocol import error_response


class AuthMiddleware:
    """The API key on every route but /health, when one is set: as a bearer token or in `x-api-key`. A refusal
    takes the shape of the request's API (`speaks_anthropic`, else OpenAI's)."""

    def __init__(self, app: Starlette, api_key: str | None):
        self.app = app
        # matched byte for byte with the header as sent: UTF-8, the command line's undecodable bytes as given
        self.key_bytes = api_key.encode("utf-8", "surrogateescape") if api_key else None
        self.state = app.state  # for tests and the CLI

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and self.key_bytes and scope["path"] != "/health":
            headers = dict(scope["headers"])
            header = headers.get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            given = token.strip() if scheme.lower() == b"bearer" else headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(given, self.key_bytes):
                sent = header or b"x-api-key" in headers
                message = ("Incorrect API key provided." if sent else
                           "Missing API key (Authorization: Bearer KEY, or x-api-key: KEY).")
                response = (anthropic_error(401, message) if speaks_anthropic(scope)
                            else error_response(401, message, code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
