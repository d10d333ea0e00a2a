"""The gateway's one error type: every client mistake is a 4xx with OpenAI's error body."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import Scope

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5  # told to clients whose request lost its instance


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "internal_error"
        if self.status == 401:
            kind = "authentication_error"
        body = {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def log_refusal(scope: Scope, exc: APIError) -> None:
    """One log line per refused request (4xx), so that an operator sees why: the request's
    id (the gateway's, else the client's X-Request-Id), the field and the reason."""
    if not 400 <= exc.status < 500:
        return
    rid = scope.get("state", {}).get("request_id") or Headers(scope=scope).get("x-request-id")
    logger.info(
        "%s %s refused with %d (request %s, field %s): %s",
        scope.get("method"), scope.get("path"), exc.status, rid or "-", exc.param or "-",
        exc.message,
    )  # fmt: skip
