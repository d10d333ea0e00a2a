"""The gateway's ASGI guard: the API key and the declared body size, checked before routing,
and every response's status counted."""

from __future__ import annotations

import hmac

from fastapi import Request
from prometheus_client import Counter
from starlette.datastructures import Headers
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdcluster.cluster.api.body import too_large
from pdcluster.cluster.api.errors import APIError, log_refusal
from pdcluster.cluster.config import GatewaySettings

# Behind the API key, with every path under /v1/ (/health, /metrics and the docs stay open).
KEYED_PATHS = ("/tokenize", "/detokenize", "/version")
# The methods counted by name in pdcluster_http_requests_total (others are `other`).
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class Guard:
    """A plain ASGI middleware: an `@app.middleware("http")` one would pass every request and
    streamed chunk through a task group and memory streams (a fraction of a millisecond
    each)."""

    def __init__(
        self,
        app: ASGIApp,
        settings: GatewaySettings,
        http_requests: Counter,
        routes: list[BaseRoute],
    ) -> None:
        self.app, self.settings = app, settings
        self.http_requests, self.routes = http_requests, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                method = scope["method"] if scope["method"] in HTTP_METHODS else "other"
                labels = (self._endpoint(scope), method, str(message["status"]))
                self.http_requests.labels(*labels).inc()
            await send(message)

        try:
            self._authorize(scope)
            self._check_size(scope)
        except APIError as exc:
            log_refusal(scope, exc)
            await exc.response()(scope, receive, counted)
            return
        await self.app(scope, receive, counted)

    def _authorize(self, scope: Scope) -> None:
        key = self.settings.api_key
        if key is None:
            return
        request = Request(scope)
        path = request.url.path
        if not path.startswith("/v1/") and path not in KEYED_PATHS:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "missing or invalid API key", "invalid_api_key")

    def _check_size(self, scope: Scope) -> None:
        length = Headers(scope=scope).get("content-length")
        limit = self.settings.max_body_bytes
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise too_large(limit)

    def _endpoint(self, scope: Scope) -> str:
        """The matched route's path; before routing, the request's path when a route has
        it; else `other` (so that probes of random paths add no series)."""
        route = scope.get("route")
        if route is not None:
            return route.path
        path = scope["path"]
        return path if any(getattr(r, "path", None) == path for r in self.routes) else "other"
