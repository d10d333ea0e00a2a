"""The gateway's one error type: every client mistake is a 4xx with OpenAI's error body."""

from __future__ import annotations

from fastapi.responses import JSONResponse

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
