"""glm-serve's API key check (`Authorization: Bearer KEY`)."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.applications import Starlette

from glmkit.serve.protocol import error_response


class AuthMiddleware:
    """`Authorization: Bearer KEY` on every route but /health, when an API key is set."""

    def __init__(self, app: Starlette, api_key: str | None):
        self.app = app
        self.api_key = api_key
        self.state = app.state  # for tests and the CLI

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and self.api_key and scope["path"] != "/health":
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                message = "Incorrect API key provided." if header else "Missing API key (Authorization: Bearer KEY)."
                await error_response(401, message, code="invalid_api_key")(scope, receive, send)
                return
        await self.app(scope, receive, send)
