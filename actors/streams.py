"""Per-request output streams that a consumer pulls, a batch per call.

The router reads an instance, and a client reads the router, by plain actor calls: one call
starts a request and returns its first batch, each next call returns the outputs produced
since. Small replies travel inline, so a consumer that hangs up or dies mid-stream leaves
nothing in the object store (a cancelled Ray streaming generator can leave an item pinned).
A stream nobody has pulled for `idle_timeout_s` lost its consumer; its owner aborts it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine.outputs import EngineCoreOutput


@dataclass
class _Stream:
    queue: asyncio.Queue[EngineCoreOutput] = field(default_factory=asyncio.Queue)
    last_pull: float = field(default_factory=time.monotonic)
    pulling: bool = False


class OutputStreams:
    """The open streams of one actor; every method runs on that actor's event loop."""

    def __init__(self, idle_timeout_s: float) -> None:
        self.idle_timeout_s = idle_timeout_s
        self._streams: dict[str, _Stream] = {}
        self._closed_unopened: dict[str, float] = {}  # aborts that overtook their start

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._streams))

    def open(self, request_id: str) -> None:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._streams[request_id] = _Stream()

    def aborted_before_start(self, request_id: str) -> bool:
        """Whether the request's abort arrived before the call that starts it (Ray may run
        a call whose arguments are still in transfer after a later call)."""
        return self._closed_unopened.pop(request_id, None) is not None

    def put(self, out: EngineCoreOutput) -> None:
        """Queue an output for its consumer; dropped when its stream was closed."""
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.queue.put_nowait(out)

    async def next_batch(self, request_id: str) -> list[EngineCoreOutput]:
        """Wait for an output, then take every other one queued. A stream ends (and closes)
        with a finished output; an unknown or closed one reads as aborted."""
        stream = self._streams.get(request_id)
        if stream is None:
            return [EngineCoreOutput(request_id, [], finish_reason="abort")]
        stream.pulling = True
        try:
            batch = [await stream.queue.get()]
        finally:
            stream.pulling = False
            stream.last_pull = time.monotonic()
        while not stream.queue.empty():
            batch.append(stream.queue.get_nowait())
        if batch[-1].finished and self._streams.get(request_id) is stream:
            del self._streams[request_id]
        return batch

    def close(self, request_id: str) -> None:
        """End a stream now; a pull waiting on it reads an abort."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            self._closed_unopened[request_id] = time.monotonic()
        else:
            stream.queue.put_nowait(EngineCoreOutput(request_id, [], finish_reason="abort"))

    def orphaned(self) -> list[str]:
        """Streams with no pull waiting and none for `idle_timeout_s`: their consumer died."""
        deadline = time.monotonic() - self.idle_timeout_s
        for rid in [r for r, t in self._closed_unopened.items() if t < deadline]:
            del self._closed_unopened[rid]
        return [rid for rid, s in self._streams.items() if not s.pulling and s.last_pull < deadline]


async def reap_orphans(streams: OutputStreams, abort: Callable[[list[str]], None]) -> None:
    """Run for an actor's lifetime: abort the requests whose consumers went away."""
    while True:
        await asyncio.sleep(min(1.0, streams.idle_timeout_s / 4))
        if orphans := streams.orphaned():
            abort(orphans)
