"""The gateway's server-sent events, without a cluster: chunk bytes and the response's
streaming, ending and disconnect handling."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from pdcluster.cluster.api.sse import DONE, ChunkEncoder, EventStreamResponse

BASE = {"id": 'cmpl-é"\\x', "object": "text_completion", "created": 17, "model": "m/☃"}


@pytest.mark.parametrize(
    ("choices", "usage"),
    [
        ([{"index": 0, "text": 'é\n"😀\ud800', "logprobs": None, "finish_reason": None}], None),
        ([{"index": 1, "delta": {}, "finish_reason": "error", "error": "x"}], None),
        ([], {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}),
    ],
)
def test_chunks_are_the_json_of_the_whole_object(choices, usage):
    whole: dict[str, Any] = {**BASE, "choices": choices}
    if usage is not None:
        whole["usage"] = usage
    encoder = ChunkEncoder(BASE["id"], BASE["object"], BASE["created"], BASE["model"])
    event = encoder.event(choices, usage)
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n")
    assert json.loads(event[6:]) == whole


def test_chunks_are_utf8_and_write_a_non_finite_float_as_null_as_vllm_does():
    encoder = ChunkEncoder(BASE["id"], BASE["object"], BASE["created"], BASE["model"])
    event = encoder.event([{"index": 0, "text": "é😀", "logprob": float("-inf")}])
    assert '"text":"é😀","logprob":null}]}'.encode() in event


class _Client:
    """ASGI receive/send of a client that disconnects after `leave_after` body events."""

    def __init__(self, leave_after: int | None = None) -> None:
        self.sent: list[dict[str, Any]] = []
        self.leave_after = leave_after
        self.left = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        bodies = [m for m in self.sent if m.get("body")]
        if self.leave_after is not None and len(bodies) >= self.leave_after:
            self.left.set()


def _events(log: list[str], count: int | None) -> AsyncGenerator[bytes, None]:
    """`count` events, then DONE (None: events until cancelled); logs its cleanup."""

    async def gen() -> AsyncGenerator[bytes, None]:
        try:
            i = 0
            while count is None or i < count:
                yield f"data: {i}\n\n".encode()
                i += 1
                await asyncio.sleep(0.001)
            yield DONE
        finally:
            log.append("closed")

    return gen()


def _serve(response: EventStreamResponse, client: _Client) -> None:
    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    asyncio.run(asyncio.wait_for(response(scope, client.receive, client.send), 10))


def test_the_stream_is_sent_and_ended():
    log: list[str] = []
    client = _Client()
    _serve(EventStreamResponse(_events(log, 3)), client)
    start, *bodies, end = client.sent
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert headers[b"cache-control"] == b"no-cache"
    assert [b["body"] for b in bodies] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", DONE]
    assert all(b["more_body"] for b in bodies) and end == {
        "type": "http.response.body",
        "body": b"",
        "more_body": False,
    }
    assert log == ["closed"]


def test_a_client_that_leaves_closes_the_events():
    log: list[str] = []
    client = _Client(leave_after=2)
    _serve(EventStreamResponse(_events(log, None)), client)  # endless: ends only if cancelled
    assert log == ["closed"]
    assert 2 <= len([m for m in client.sent if m.get("body")]) <= 3
    assert not any(m.get("more_body") is False for m in client.sent)


def test_a_failing_stream_closes_the_events_and_raises():
    log: list[str] = []

    async def failing_send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            raise RuntimeError("socket gone")

    client = _Client()
    client.send = failing_send  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="socket gone"):
        _serve(EventStreamResponse(_events(log, None)), client)
    assert log == ["closed"]
