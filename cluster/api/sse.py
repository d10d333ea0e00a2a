"""Server-sent events of the OpenAI streaming APIs: chunk encoding and the response.

Every chunk of one response shares its `id`, `object`, `created` and `model`: they are
encoded once, and each chunk encodes only its choices (and usage), with orjson: compact
UTF-8 JSON as vLLM's pydantic writes it (text unescaped, a non-finite float as null). What
orjson refuses (a lone surrogate, an integer past 64 bits) is written by the standard
library instead, escaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
_standard = json.JSONEncoder(separators=(",", ":")).encode


def _encode(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except (orjson.JSONEncodeError, TypeError):  # a lone surrogate, a huge integer
        return _standard(value).encode()


class ChunkEncoder:
    """`data: {...}\\n\\n` events of one streamed response."""

    def __init__(self, rid: str, obj: str, created: int, model: str) -> None:
        base = {"id": rid, "object": obj, "created": created, "model": model}
        self._head = b"data: " + _encode(base)[:-1] + b',"choices":'

    def event(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        tail = b"}\n\n" if usage is None else b',"usage":' + _encode(usage) + b"}\n\n"
        return self._head + _encode(choices) + tail


def named_event(payload: dict[str, Any]) -> bytes:
    """`event: TYPE\ndata: {...}\n\n`, as the Responses API streams its typed events."""
    return b"event: " + payload["type"].encode() + b"\ndata: " + _encode(payload) + b"\n\n"


@dataclass(frozen=True)
class UsageIn:
    """Which chunks of a stream carry usage (`stream_options`)."""

    last_chunk: bool = False  # include_usage: a last chunk with no choices
    # continuous_usage_stats (with include_usage, as vLLM): the usage so far in each chunk
    every_chunk: bool = False

    @classmethod
    def of(cls, options: Any) -> UsageIn:
        """From a body's `stream_options` (None: no usage)."""
        if options is None:
            return cls()
        return cls(options.include_usage, options.include_usage and options.continuous_usage_stats)


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response of already-encoded events.

    One task streams the events (no per-event hop through a task group or memory stream)
    while the request's task waits for it or for the client to go away, whichever comes
    first; then the stream is cancelled, and closing `events` runs its cleanup, which
    aborts the engine requests it drives.
    """

    def __init__(
        self, events: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None
    ) -> None:
        headers = {"Cache-Control": "no-cache", **(headers or {})}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait((stream, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not stream.done():
                stream.cancel()
                await asyncio.wait((stream,))
            await self.events.aclose()  # its cleanup (the abort) runs before we end
        if not stream.cancelled():
            stream.result()  # an error while streaming propagates
        if self.background is not None:
            await self.background()

    async def _stream(self, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _until_disconnect(receive: Receive) -> None:
    with contextlib.suppress(OSError):
        while (await receive())["type"] != "http.disconnect":
            pass
