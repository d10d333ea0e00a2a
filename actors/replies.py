"""Ray call results awaited on one event loop, many per cross-thread wakeup.

`await ref` hands each result from Ray's core-worker thread to the loop on its own: a
`concurrent.futures.Future`, an asyncio future chained to it, one self-pipe write per result,
and (under `asyncio.wait_for`) a task wrapping the ref. `Replies` registers a plain callback
per call instead: results that land together (a step of many instances, answered while the
loop is busy) wait in one queue and reach the loop in one wakeup.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from typing import Any

import ray


class Replies:
    """Results of Ray calls for coroutines on `loop` (whose methods run on `loop` alone)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._landed: deque[tuple[asyncio.Future, Any]] = deque()
        self._lock = threading.Lock()
        self._wake_scheduled = False  # a `_hand_over` is on its way to the loop

    def future(self, ref: ray.ObjectRef) -> asyncio.Future:
        """A future of the call's result (or its error, as `await ref` raises it); the
        caller keeps `ref` referenced until it is done."""
        future = self._loop.create_future()
        ref._on_completed(lambda value: self._land(future, value))
        return future

    def _land(self, future: asyncio.Future, value: Any) -> None:
        """On Ray's thread: queue the result; the first of a batch wakes the loop."""
        with self._lock:
            self._landed.append((future, value))
            if self._wake_scheduled:
                return
            self._wake_scheduled = True
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits these now
            self._loop.call_soon_threadsafe(self._hand_over)

    def _hand_over(self) -> None:
        with self._lock:
            landed, self._landed = self._landed, deque()
            self._wake_scheduled = False
        for future, value in landed:
            if future.done():  # its awaiter was cancelled
                continue
            if isinstance(value, ray.exceptions.RayTaskError):
                future.set_exception(value.as_instanceof_cause())
            elif isinstance(value, ray.exceptions.RayError):
                future.set_exception(value)
            else:
                future.set_result(value)
