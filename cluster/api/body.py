"""Request bodies read and validated: size-limited, strict JSON, text the tokenizer can take,
and pydantic errors turned into a 400 that names the field."""

from __future__ import annotations

import json
import re
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from pdcluster.cluster.api.errors import APIError

BodyT = TypeVar("BodyT", bound=BaseModel)
# A \uXXXX escape of a UTF-16 surrogate: only through one can an ASCII body hold a lone one.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes", "body_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it outgrows `limit` bytes (a chunked upload has no
    Content-Length for the guard to check)."""
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model: type[BodyT], limit: int) -> BodyT:
    """The body as `model`; any fault is a 400 (413 past `limit` bytes)."""
    body = await read_body(request, limit)
    try:
        data = json.loads(body, parse_constant=_reject_constant)
        # Strings reach the tokenizer: a lone surrogate (\ud800) is not text.
        if not body.isascii() or SURROGATE_ESCAPE.search(body):
            json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise APIError(400, "request body holds invalid Unicode", "invalid_json") from None
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", "invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # The deepest error names the culprit (a union's other branches fail shallower).
        error = max(exc.errors(), key=lambda e: len(e["loc"]))
        param = ".".join(str(p) for p in error["loc"] if not _is_type_tag(p))
        if error["type"] in ("unsupported_value", "invalid_value"):  # names its field
            raise APIError(400, error["msg"], error["type"], param or None) from None
        raise APIError(400, f"{param}: {error['msg']}", "invalid_value", param) from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply", "invalid_json") from None


def _is_type_tag(part: str | int) -> bool:
    """Pydantic's name for a union member in an error location (`str`, `list[int]`)."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")
