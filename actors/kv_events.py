"""An instance's prefix-cache event log, read by every gateway replica with its own cursor.

Events are (stored, block hash) in the order the instance's prefix cache changed. The log
keeps the last `capacity` of them and the set they add up to, so a reader that is new,
fell behind, or knew an earlier incarnation of the instance gets the whole set instead.
"""

from __future__ import annotations

from collections import deque
from itertools import islice

from pdcluster.actors.messages import KVEvents
from pdcluster.connectors.base import new_epoch


class KVEventLog:
    def __init__(self, capacity: int = 65536) -> None:
        self.epoch = new_epoch()
        self._events: deque[tuple[bool, int]] = deque(maxlen=capacity)
        self._next_seq = 0  # sequence number of the next event appended
        self._cached: set[int] = set()

    def extend(self, events: list[tuple[bool, int]]) -> None:
        for stored, block_hash in events:
            if stored:
                self._cached.add(block_hash)
            else:
                self._cached.discard(block_hash)
        self._events.extend(events)
        self._next_seq += len(events)

    @property
    def cursor(self) -> int:
        """A reader that has read up to here has read everything."""
        return self._next_seq

    def since(self, epoch: str | None, cursor: int) -> KVEvents:
        """The events after `cursor` (a reader's last `KVEvents.cursor`), or the whole set."""
        first_kept = self._next_seq - len(self._events)
        if epoch != self.epoch or not first_kept <= cursor <= self._next_seq:
            return KVEvents(self.epoch, self._next_seq, list(self._cached), reset=True)
        last: dict[int, bool] = {}  # each hash's final state: the order within is moot
        for stored, block_hash in islice(self._events, cursor - first_kept, None):
            last[block_hash] = stored
        return KVEvents(
            self.epoch,
            self._next_seq,
            [h for h, stored in last.items() if stored],
            [h for h, stored in last.items() if not stored],
        )
