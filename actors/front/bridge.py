"""The Front's thread and event loop, and the way its outputs reach callers on other loops.

Every Ray call of a gateway replica runs on one event loop of its own thread, so callers on
any event loop (a gateway's, or a fresh `asyncio.run` per call) can stream. A caller on that
loop itself gets its batches at once; for every other loop, the batches one loop iteration
produced cross threads in one call, however many requests and pulls they hold.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pdcluster.engine.outputs import EngineCoreOutput

Batch = tuple[int, list[EngineCoreOutput]]  # (the caller's index of the request, outputs)


@dataclass(frozen=True)
class Sink:
    """Where one request's batches go: a queue on the caller's event loop (the caller's
    index of the request with each batch)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Batch]
    index: int


class LoopThread:
    """An event loop running on a daemon thread of its own."""

    def __init__(self, name: str) -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro_or_fn: Coroutine[Any, Any, Any] | Callable[[], Any]) -> Future[Any]:
        """Run a coroutine, or a plain function, on the loop; its result as a future."""
        coro = coro_or_fn if asyncio.iscoroutine(coro_or_fn) else _as_coro(coro_or_fn)
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def on_loop(self, caller: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
        """Run `fn(*args)` on the loop: now when the caller is on it, else soon."""
        if caller is self.loop:
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout_s: float) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=timeout_s)


class Outbox:
    """Batches on their way to callers (used on the owning loop alone). `on_unread` gets the
    client request ids of batches whose caller's loop is closed: nobody reads them."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_unread: Callable[[list[str]], None]
    ) -> None:
        self._loop = loop
        self._on_unread = on_unread
        # Batches for callers, by their event loop, until the end of this loop iteration
        self._outgoing: dict[asyncio.AbstractEventLoop, list[_Outgoing]] = {}

    def send(self, sink: Sink, client_id: str, batch: list[EngineCoreOutput]) -> None:
        """Hand a batch to its caller: at once on the owning loop; for another loop, what
        this loop iteration queued for it crosses threads in one call (`_flush`)."""
        if sink.loop is self._loop:
            sink.queue.put_nowait((sink.index, batch))
            return
        if not self._outgoing:
            self._loop.call_soon(self._flush)
        self._outgoing.setdefault(sink.loop, []).append((sink, client_id, batch))

    def _flush(self) -> None:
        outgoing, self._outgoing = self._outgoing, {}
        for loop, items in outgoing.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's event loop is closed: nobody reads these
                self._on_unread([client_id for _, client_id, _ in items])


_Outgoing = tuple[Sink, str, list[EngineCoreOutput]]  # (sink, the caller's request id, batch)


def _put_all(items: list[_Outgoing]) -> None:
    """On the caller's event loop: hand each batch to its stream."""
    for sink, _, batch in items:
        sink.queue.put_nowait((sink.index, batch))


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's where it is installed (ray[serve] brings it, with uvicorn[standard]): the loop
    uvicorn would serve on, for a gateway served from the Front's loop; else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def _as_coro(fn: Callable[[], Any]) -> Any:
    return fn()
