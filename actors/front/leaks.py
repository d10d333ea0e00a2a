"""Pull calls are no leak: object ids of every gateway replica's pulls in this process, for
tests that check that the object store holds nothing of a finished request.

A pull's reply lives in the object store while it is awaited (a long poll) and a moment
after; a leak check started at `since` subtracts the pulls in flight and those started
after it."""

from __future__ import annotations

import time
import weakref
from collections import deque

MAX_RECENT_PULLS = 100_000


class PullIds:
    """Object ids of one replica's pulls in flight, and of its recent ones."""

    def __init__(self) -> None:
        self._in_flight: set[str] = set()
        self._recent: deque[tuple[float, str]] = deque(maxlen=MAX_RECENT_PULLS)
        _ALL.add(self)

    def started(self, object_id: str) -> None:
        self._in_flight.add(object_id)
        self._recent.append((time.monotonic(), object_id))

    def done(self, object_id: str) -> None:
        self._in_flight.discard(object_id)

    def since(self, since: float) -> set[str]:
        """Object ids of pulls in flight or started after `since` (time.monotonic())."""
        recent = {i for t, i in list(self._recent) if t >= since}
        return set(self._in_flight) | recent


_ALL: weakref.WeakSet[PullIds] = weakref.WeakSet()


def pull_object_ids(since: float) -> set[str]:
    """`PullIds.since` of every replica of this process: objects that are no leak."""
    return {i for pulls in list(_ALL) for i in pulls.since(since)}
