"""The cluster KV pool's owner: one long-lived actor per pool that owns every pooled object.

Ray frees an object when its owner dies, so pooled KV is owned here, not by the instance that
computed it: a publisher puts its blocks, calls `publish`, and drops its reference; this actor
copies the object into one of its own (off its event loop) and indexes it
(`connectors.kv_pool_index`). An instance's death loses nothing; this actor's death loses the
pool (readers then recompute). Eviction drops the object; Ray's object spilling moves cold
entries to disk meanwhile, so the store's spill directory is the pool's disk tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

import ray
from ray.exceptions import RayError

from pdcluster.actors.kv_events import KVEventLog
from pdcluster.actors.messages import KVEvents
from pdcluster.actors.pool_messages import KVPoolStats
from pdcluster.connectors.kv_pool_index import KVPoolIndex, PoolHit, PoolPublish

logger = logging.getLogger(__name__)

# The pool's default capacity: this share of the cluster's object store (the rest carries
# P->D handoffs, encoder outputs and pixels).
KV_POOL_STORE_SHARE = 0.5
GiB = 1024**3


def kv_pool_actor_name(pool: str) -> str:
    return f"{pool}-kvpool"


def kv_pool_capacity_bytes(size_gib: float | None) -> int:
    """Bytes of `size_gib`, or, for None, KV_POOL_STORE_SHARE of the object store."""
    if size_gib is not None:
        return int(size_gib * GiB)
    return int(KV_POOL_STORE_SHARE * ray.cluster_resources().get("object_store_memory", 0))


class KVPoolActor:
    """Wrap with `ray.remote(KVPoolActor)`, named `kv_pool_actor_name(pool)`."""

    def __init__(self, capacity_bytes: int, pin_s: float) -> None:
        logging.basicConfig(level=logging.INFO)
        self.index = KVPoolIndex(capacity_bytes, pin_s)
        self._events = KVEventLog()
        self._published: asyncio.Event | None = None  # set (and replaced) at every publish
        self._num_failed_publishes = 0
        self._num_refused_releases = 0
        self._num_bytes_published = 0
        logger.info("KV pool: %.2f GiB", capacity_bytes / GiB)

    async def publish(self, entry: PoolPublish) -> bool:
        """Own a copy of the publisher's object and hold it; False when it was not kept
        (held already, too large, or the publisher is gone)."""
        if self.index.capacity_bytes < entry.nbytes:
            return False
        try:
            arrays = await entry.refs[0]
            own = await asyncio.to_thread(ray.put, arrays)  # the copy this actor owns
        except RayError as exc:
            logger.warning("KV pool: a published object is gone: %s", exc)
            self._num_failed_publishes += 1
            return False
        finally:
            arrays = None
        kept = self.index.add(dataclasses.replace(entry, refs=[own]))
        if self._published is not None:  # a kept entry stores blocks, and may evict some
            self._published.set()
            self._published = None
        self._num_bytes_published += entry.nbytes if kept else 0
        return kept

    async def lookup(self, layout: str, block_hashes: list[int]) -> PoolHit:
        """The longest run of `block_hashes`, from the first, held here; pinned until
        `release` (or its pin lease). The hit names this incarnation (`epoch`)."""
        hit = self.index.lookup(layout, list(block_hashes))
        return dataclasses.replace(hit, epoch=self._events.epoch)

    async def release(self, lookup_id: int, epoch: str) -> None:
        """A reader is done with a hit; one from another incarnation is refused (counted):
        lookup ids start again with every incarnation."""
        if epoch != self._events.epoch:
            self._num_refused_releases += 1
            return
        self.index.release(lookup_id)

    async def events(
        self, epoch: str | None = None, events_after: int = -1, wait_s: float = 0.0
    ) -> KVEvents:
        """The blocks that became reachable here or stopped being so after a reader's cursor
        (`epoch`, `events_after`: from its previous answer), as instances' KV events are:
        routers know from these which prefixes any P can load instead of computing. With
        nothing new, the answer waits up to `wait_s` seconds for a publish (a long-poll)."""
        self._events.extend(self.index.take_events())
        if (epoch, events_after) == (self._events.epoch, self._events.cursor) and wait_s > 0:
            if self._published is None:
                self._published = asyncio.Event()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._published.wait(), wait_s)
            self._events.extend(self.index.take_events())
        return self._events.since(epoch, events_after)

    async def object_ids(self) -> list[str]:
        """Hex ids of the objects held (what a leak check may find in the store)."""
        return [ref.hex() for ref in self.index.refs()]

    async def stats(self) -> KVPoolStats:
        return KVPoolStats(
            **self.index.stats(),
            num_failed_publishes=self._num_failed_publishes,
            num_refused_releases=self._num_refused_releases,
            bytes_published=self._num_bytes_published,
        )
