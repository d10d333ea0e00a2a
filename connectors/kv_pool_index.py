"""The cluster KV pool's index: which runs of full KV blocks it holds, keyed by the engine's
block hash chain (`engine.kv_cache_manager`, the same hashes the prefix cache and KV events
use), bounded in bytes with least-recently-used eviction. No Ray here: the owner actor
(`actors/kv_pool.py`) holds one of these, and the objects are opaque to it.

An entry is one object: the blocks of one publish (a request's run of new full blocks), as
arrays over runs of rows. A block's hash names its whole prefix, so a hit is the longest run
of the asked hashes, from the first, that the pool holds, possibly across entries.

Invariants:
- `_where` maps a (layout, hash) to the one entry row holding that block;
- an entry with pins is never evicted: a lookup pins the entries of its hit until
  `release` or until its pin lease (`pin_s`) runs out (a reader that died);
- `num_bytes <= capacity_bytes` except while pinned entries alone exceed it.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_COUNTERS = ("num_publishes", "num_rejected", "num_evictions", "num_lookups", "num_hit_blocks")


@dataclass(frozen=True)
class PoolPublish:
    """One publish: an object of a run of full blocks (row i holds `block_hashes[i]`), as
    arrays over runs of `run_lengths` rows; what a publisher sends the pool's owner, and
    what the owner's index holds once the owner made the object its own."""

    layout: str  # the KV layout the rows are in (`RayKVPoolConnector`'s layout key)
    block_hashes: tuple[int, ...]
    refs: list[Any]  # [ObjectRef]: inside a list so that Ray never resolves it in transit
    run_lengths: tuple[int, ...]
    nbytes: int
    digests: tuple[int, ...] | None = None  # each row's checksum (connectors/checksum.py)


@dataclass(frozen=True)
class PoolPart:
    """Consecutive blocks of a hit inside one entry: rows [first_row, first_row + num_blocks)
    of the entry's object, a list of arrays of `run_lengths` rows each."""

    refs: list[Any]  # [ObjectRef]: inside a list so that Ray never resolves it in transit
    run_lengths: tuple[int, ...]
    first_row: int
    num_blocks: int
    digests: tuple[int, ...] | None = None  # the entry's, one per row of its object


@dataclass(frozen=True)
class PoolHit:
    """The blocks the pool holds for the asked hashes, in order; pinned until released
    (naming the lookup and the pool's incarnation, `epoch`)."""

    lookup_id: int
    parts: tuple[PoolPart, ...] = ()
    epoch: str = ""

    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self.parts)


@dataclass
class _Entry:
    refs: list[Any]
    run_lengths: tuple[int, ...]
    keys: list[tuple[str, int]]  # (layout, hash) per row; the rows `_where` names are ours
    nbytes: int
    digests: tuple[int, ...] | None
    num_pins: int = 0


@dataclass
class _Pin:
    deadline_s: float
    entry_ids: list[int] = field(default_factory=list)


class KVPoolIndex:
    def __init__(
        self, capacity_bytes: int, pin_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if capacity_bytes < 0 or pin_s <= 0:
            raise ValueError("capacity_bytes must be >= 0 and pin_s positive")
        self.capacity_bytes = capacity_bytes
        self.pin_s = pin_s
        self._clock = clock
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._where: dict[tuple[str, int], tuple[int, int]] = {}  # key -> (entry id, row)
        self._pins: dict[int, _Pin] = {}
        self._ids = itertools.count(1)
        self.num_bytes = 0
        self._counters = dict.fromkeys(_COUNTERS, 0)
        # (stored, block hash) as blocks become reachable or not, for routers (the pool's
        # tier of the KV events instances publish); drained by `take_events`.
        self._events: list[tuple[bool, int]] = []

    def __len__(self) -> int:
        return len(self._entries)

    # ---- publish --------------------------------------------------------------------------
    def add(self, entry: PoolPublish) -> bool:
        """Hold one entry; False, holding nothing, when every block is held already or the
        entry cannot fit even after evicting every unpinned one."""
        num_rows, num_hashes = sum(entry.run_lengths), len(entry.block_hashes)
        if num_rows != num_hashes or not num_hashes:
            raise ValueError(f"{num_rows} rows for {num_hashes} block hashes")
        if entry.digests is not None and len(entry.digests) != num_rows:
            raise ValueError(f"{len(entry.digests)} checksums for {num_rows} rows")
        self._expire_pins()
        keys = [(entry.layout, h) for h in entry.block_hashes]
        nbytes = entry.nbytes
        if all(k in self._where for k in keys) or not self._make_room(nbytes):
            self._counters["num_rejected"] += 1
            return False
        entry_id = next(self._ids)
        self._entries[entry_id] = _Entry(entry.refs, entry.run_lengths, keys, nbytes, entry.digests)
        for row, key in enumerate(keys):
            if key not in self._where:
                self._where[key] = (entry_id, row)
                self._events.append((True, key[1]))
        self.num_bytes += nbytes
        self._counters["num_publishes"] += 1
        return True

    def _make_room(self, nbytes: int) -> bool:
        """Evict least recently used unpinned entries until `nbytes` fit; evicts nothing when
        they cannot fit at all."""
        pinned = sum(e.nbytes for e in self._entries.values() if e.num_pins)
        if pinned + nbytes > self.capacity_bytes:
            return False
        for entry_id in list(self._entries):
            if self.num_bytes + nbytes <= self.capacity_bytes:
                break
            if self._entries[entry_id].num_pins == 0:
                self._evict(entry_id)
        return True

    def _evict(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        for row, key in enumerate(entry.keys):
            if self._where.get(key) == (entry_id, row):
                del self._where[key]
                self._events.append((False, key[1]))
        self.num_bytes -= entry.nbytes
        self._counters["num_evictions"] += 1

    # ---- lookup ---------------------------------------------------------------------------
    def lookup(self, layout: str, block_hashes: list[int]) -> PoolHit:
        """The longest run of `block_hashes`, from the first, that the pool holds; its entries
        are pinned (and become the most recently used) until `release(hit.lookup_id)`."""
        self._expire_pins()
        self._counters["num_lookups"] += 1
        lookup_id = next(self._ids)
        parts: list[list[Any]] = []  # [entry id, first row, num blocks]
        for block_hash in block_hashes:
            where = self._where.get((layout, block_hash))
            if where is None:
                break
            entry_id, row = where
            last = parts[-1] if parts else None
            if last is not None and last[0] == entry_id and last[1] + last[2] == row:
                last[2] += 1
            else:
                parts.append([entry_id, row, 1])
        if not parts:
            return PoolHit(lookup_id)
        pin = self._pins[lookup_id] = _Pin(self._clock() + self.pin_s)
        for entry_id in dict.fromkeys(p[0] for p in parts):
            self._entries[entry_id].num_pins += 1
            self._entries.move_to_end(entry_id)
            pin.entry_ids.append(entry_id)
        hit = PoolHit(
            lookup_id,
            tuple(
                PoolPart(
                    self._entries[e].refs,
                    self._entries[e].run_lengths,
                    row,
                    n,
                    self._entries[e].digests,
                )
                for e, row, n in parts
            ),
        )
        self._counters["num_hit_blocks"] += hit.num_blocks
        return hit

    def release(self, lookup_id: int) -> None:
        """The reader is done with a hit (landed, failed or abandoned); unknown ids are ignored."""
        pin = self._pins.pop(lookup_id, None)
        if pin is None:
            return
        for entry_id in pin.entry_ids:
            entry = self._entries.get(entry_id)
            if entry is not None:
                entry.num_pins -= 1

    def _expire_pins(self) -> None:
        now = self._clock()
        for lookup_id in [i for i, pin in self._pins.items() if pin.deadline_s <= now]:
            self.release(lookup_id)

    def take_events(self) -> list[tuple[bool, int]]:
        events, self._events = self._events, []
        return events

    def refs(self) -> list[Any]:
        """Every object held, oldest first."""
        return [ref for entry in self._entries.values() for ref in entry.refs]

    def stats(self) -> dict[str, int]:
        return {
            **self._counters,
            "num_bytes": self.num_bytes,
            "capacity_bytes": self.capacity_bytes,
            "num_entries": len(self._entries),
            "num_blocks": len(self._where),
            "num_pinned_entries": sum(1 for e in self._entries.values() if e.num_pins),
        }
