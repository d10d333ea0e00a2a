"""KV connector to the cluster KV pool (`actors/kv_pool.py`) in Ray's object store.

Checked like a P->D handoff (connectors/checksum.py): a publish carries every block's
checksum, computed on the publisher thread from the copy it puts; a load checks each block as
it lands, and a mismatch is recomputed like any failed pool load.

Lookup (a P or mixed instance): after the local prefix cache, the pool is asked, without
waiting, for the longest run of the request's further full blocks (by the engine's block
hashes). Until it answers, `get_num_new_matched_tokens` says "not known yet" and the
scheduler passes the request over while others step. A hit is loaded like a P->D handoff:
`load_async`, the request waits in WAITING_FOR_REMOTE_KVS holding its blocks, the fetched
runs are copied into them, and the scheduler enters them into the local prefix cache. The
pool pins a hit's entries until the reader releases them. A hit whose object is gone
(evicted, its owner lost) fails the load, and the scheduler recomputes: a cache never fails
a request.

Publish (every role): a request that finished normally publishes the full blocks whose KV it
holds and the pool, as far as this instance knows, does not: the ones after its local and
pool hits on P or mixed (the prompt; on mixed the output too), the ones after P's prompt on D
(the output, so the next turn's prefix includes the reply). One `ray.put` of a copy of the
blocks' runs, handed to the pool's owner, which owns a copy of its own. The blocks are copied
out as the request finishes (~1 ms for 6 MB) and the put (5-20 ms) runs on a thread of its
own: a publish never runs on the step loop, so it never delays another stream's next token.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import ray
import torch
from ray.exceptions import RayError

from pdcluster.connectors import faults
from pdcluster.connectors.base import HeadShardedKV, KVConnectorBase, KVTransferParams
from pdcluster.connectors.checksum import ChecksumError, row_digests
from pdcluster.connectors.kv_pool_index import PoolHit, PoolPublish
from pdcluster.connectors.ray_kv import LOCAL_RESOLVE_TIMEOUT_S
from pdcluster.connectors.ray_kv_layout import BlockArrays, Latency, plan_segments
from pdcluster.connectors.stats import KVConnectorStats, KVPoolUse
from pdcluster.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)

_PUBLISHABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
_COUNTERS = (  # KVPoolUse fields
    "hits",
    "misses",
    "hit_tokens",
    "loads",
    "failed_loads",
    "checksum_failures",
    "publishes",
    "bytes_published",
    "bytes_loaded",
)


@dataclass
class _Hit:
    """A pool answer for one request: blocks [first_block, first_block + hit.num_blocks)."""

    hit: PoolHit
    first_block: int


class PoolPart(NamedTuple):
    """One pool object a load reads: its ref, its number of runs (arrays),
    (array_index, src_row, dst_block, count) copies and its rows' checksums."""

    ref: Any
    num_runs: int
    segments: list[tuple[int, int, int, int]]
    digests: tuple[int, ...] | None


@dataclass
class PoolLoad:
    """One request's load, part by part."""

    request_id: str
    lookup_id: int
    epoch: str  # the pool's incarnation that answered the lookup
    first_block: int  # the request's first block it fills
    parts: list[PoolPart]
    nbytes: int
    started_s: float = 0.0
    ready_s: float = 0.0  # not landed before (a DELAY_LOAD fault)
    futures: list[Any] = field(default_factory=list)


class RayKVPoolConnector(KVConnectorBase):
    def __init__(
        self,
        pool: Any,
        block_size: int,
        load_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if block_size < 1 or load_timeout_s <= 0:
            raise ValueError("block_size and load_timeout_s must be positive")
        self.pool = pool  # the owner actor's handle
        self.block_size = block_size
        self.load_timeout_s = load_timeout_s
        self._clock = clock
        self._blocks: BlockArrays | None = None
        self._layout = ""
        self._asking: dict[
            str, tuple[concurrent.futures.Future, int]
        ] = {}  # rid -> (answer, first)
        self._hits: dict[str, _Hit] = {}
        self._pooled: dict[str, int] = {}  # rid -> leading blocks the pool holds, as far as known
        self._new_loads: list[PoolLoad] = []
        self._inflight: dict[str, PoolLoad] = {}
        self._failed: set[str] = set()
        self._loading: set[str] = set()  # requests whose KV this connector loaded or loads
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._load_ms = Latency()
        self._publish_ms = Latency()  # written by the publisher thread only
        self._publisher = concurrent.futures.ThreadPoolExecutor(1, "kv-pool-publish")
        self._publishing: list[concurrent.futures.Future] = []  # in submission order

    def register_kv_caches(
        self, kv_caches: torch.Tensor, draft_kv_cache: torch.Tensor | None = None
    ) -> None:
        """Entries carry the target's KV only, so that instances with and without a draft
        model share them (a draft model catches a loaded prefix up itself)."""
        self._blocks = BlockArrays(kv_caches, self.block_size)
        self._layout = self._layout_key()

    def register_head_shards(self, shards: HeadShardedKV) -> None:
        """Entries hold whole blocks: instances at any TP size share them."""
        self._block_arrays().use_head_shards(shards)
        self._layout = self._layout_key()

    def _layout_key(self) -> str:
        blocks = self._block_arrays()
        return f"{list(blocks.block_shape)}:{blocks.dtype}"

    # ---- scheduler side: lookup -----------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        first = num_computed_tokens // self.block_size  # blocks the local cache holds
        if rid not in self._hits and rid not in self._asking:
            hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
            self._pooled[rid] = first
            if self._blocks is None or first >= len(hashes):
                return 0, False
            answer = self.pool.lookup.remote(self._layout, hashes[first:]).future()
            self._asking[rid] = (answer, first)
        if rid in self._asking:
            answer, asked_first = self._asking[rid]
            if not answer.done():
                return None, False
            del self._asking[rid]
            self._take_answer(rid, answer, asked_first)
        return self._matched(rid, first)

    def _take_answer(self, rid: str, answer: concurrent.futures.Future, first: int) -> None:
        # exception() rather than result() in a try: a raise here would tie the answer and
        # this frame (and, up the stack, a step's outputs) in a cycle only the GC frees.
        error = answer.exception()
        if error is not None:
            logger.warning("request %r: KV pool lookup failed: %s", rid, error)
        hit = PoolHit(0) if error is not None else answer.result()
        self._hits[rid] = _Hit(hit, first)  # a miss too: the request is not asked about again
        self._counters["hits" if hit.num_blocks else "misses"] += 1

    def _matched(self, rid: str, first: int) -> tuple[int, bool]:
        """Tokens of the answered hit after the `first` blocks the local cache now holds.
        A local cache that lost blocks since the question makes the hit unusable."""
        found = self._hits.get(rid)
        if found is None or not found.hit.num_blocks:
            return 0, False
        end = found.first_block + found.hit.num_blocks
        if first < found.first_block or first >= end:
            self._drop_hit(rid)
            self._pooled[rid] = max(first, self._pooled.get(rid, 0))
            return 0, False
        self._pooled[rid] = end
        return (end - first) * self.block_size, True

    def _drop_hit(self, rid: str) -> None:
        found = self._hits.pop(rid, None)
        if found is not None and found.hit.num_blocks:
            self.pool.release.remote(found.hit.lookup_id, found.hit.epoch)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        if num_external_tokens <= 0:
            self._drop_hit(rid)
            return
        found = self._hits.pop(rid, None)
        if found is None:
            return
        num_blocks = num_external_tokens // self.block_size
        end = found.first_block + found.hit.num_blocks
        self._new_loads.append(self._plan_load(rid, found, block_ids, end - num_blocks, end))
        self._loading.add(rid)
        self._counters["hit_tokens"] += num_external_tokens

    def _plan_load(
        self, rid: str, found: _Hit, block_ids: list[int], first: int, end: int
    ) -> PoolLoad:
        """Copies of pool blocks [first, end) (absolute block indices) into the request's."""
        parts = []
        block = found.first_block
        nbytes_per_block = self._block_arrays().block_nbytes
        for part in found.hit.parts:
            lo, hi = max(block, first), min(block + part.num_blocks, end)
            if lo < hi:
                row = part.first_row + lo - block
                segments = plan_segments(part.run_lengths, row, list(block_ids[lo:hi]))
                parts.append(PoolPart(part.refs[0], len(part.run_lengths), segments, part.digests))
            block += part.num_blocks
        nbytes = (end - first) * nbytes_per_block
        return PoolLoad(rid, found.hit.lookup_id, found.hit.epoch, first, parts, nbytes)

    def build_connector_meta(self, scheduler_output: Any) -> list[PoolLoad]:
        loads, self._new_loads = self._new_loads, []
        return loads

    # ---- worker side: loads ---------------------------------------------------------------
    def start_load_kv(self, metadata: Any) -> None:
        """Kick every new load's fetches; waits only for objects already in this node's store
        to resolve (a fraction of a ms), never for a transfer."""
        if not isinstance(metadata, list) or not metadata:
            return
        refs = list(dict.fromkeys(part.ref for load in metadata for part in load.parts))
        local = set(ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=True)[0])
        local_futures = []
        for load in metadata:
            load.started_s = load.ready_s = self._clock()
            if delay := faults.strike(faults.Fault.DELAY_LOAD):
                load.ready_s += delay.seconds
            load.futures = [part.ref.future() for part in load.parts]
            local_futures += [f for p, f in zip(load.parts, load.futures) if p.ref in local]
            self._inflight[load.request_id] = load
        concurrent.futures.wait(local_futures, timeout=LOCAL_RESOLVE_TIMEOUT_S)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        for rid in finished_req_ids:  # aborted while loading: request_finished never comes
            self._pooled.pop(rid, None)
            self._loading.discard(rid)
        landed: set[str] = set()
        now = self._clock()
        for rid, load in list(self._inflight.items()):
            if now >= load.ready_s and all(f.done() for f in load.futures):
                del self._inflight[rid]
                if self._land(load):
                    landed.add(rid)
            elif now - load.started_s > self.load_timeout_s:
                del self._inflight[rid]
                self._fail(load, f"no result within {self.load_timeout_s} s")
        return set(), landed

    def _land(self, load: PoolLoad) -> bool:
        blocks = self._block_arrays()
        try:
            for i, part in enumerate(load.parts):  # no local future: see _take_answer
                arrays = load.futures[i].result()
                blocks.copy_in(arrays, part.segments, part.num_runs, False, part.digests)
        except ChecksumError as e:
            self._counters["checksum_failures"] += 1
            self._fail(load, str(e))
            return False
        except (RayError, ValueError, TypeError, IndexError, RuntimeError) as e:
            self._fail(load, f"{type(e).__name__}: {e}")
            return False
        self._release(load)
        self._load_ms.add((self._clock() - load.started_s) * 1e3)
        self._counters["loads"] += 1
        self._counters["bytes_loaded"] += load.nbytes
        return True

    def _fail(self, load: PoolLoad, reason: str) -> None:
        logger.warning("request %r: KV pool load failed (recomputing): %s", load.request_id, reason)
        self._release(load)
        rid = load.request_id
        if rid in self._pooled:  # the pool lacks these blocks: the recomputed ones go there
            self._pooled[rid] = min(self._pooled[rid], load.first_block)
        self._failed.add(rid)
        self._counters["failed_loads"] += 1

    def _release(self, load: PoolLoad) -> None:
        """Drop every reference to the load's objects and unpin them in the pool."""
        load.futures, load.parts = [], []
        self.pool.release.remote(load.lookup_id, load.epoch)

    def get_failed_loads(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed

    def load_failure_recomputes(self, request: Request) -> bool:
        return request.request_id in self._loading  # a cache: a lost entry is recomputed

    def has_pending(self) -> bool:
        """Publishes still on their way to the pool."""
        self._publishing = [f for f in self._publishing if not f.done()]
        return bool(self._publishing)

    def needs_polling(self) -> bool:
        return (
            bool(self._asking or self._new_loads or self._inflight or self._failed)
            or self.has_pending()
        )

    # ---- publish ----------------------------------------------------------------------------
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        rid = request.request_id
        self._drop_hit(rid)
        self._asking.pop(rid, None)
        self._loading.discard(rid)
        first = self._pooled.pop(rid, None)
        if request.status not in _PUBLISHABLE or self._blocks is None:
            return False, None
        if first is None:  # never looked up here: on D, P published the prompt's full blocks
            params = request.kv_transfer_params
            remote = params is not None and params.do_remote_prefill
            first = params.num_tokens // self.block_size if remote else 0
        num_full = min(
            request.num_computed_tokens // self.block_size,
            len(request.block_hashes),
            len(block_ids),
        )
        if first < num_full:
            self._publish(request.block_hashes[first:num_full], block_ids[first:num_full])
        return False, None

    def _publish(self, block_hashes: list[int], block_ids: list[int]) -> None:
        """A copy of the blocks' runs, put and handed to the pool on the publisher thread."""
        arrays, run_lengths = self._block_arrays().runs(block_ids, owned=True)
        nbytes = sum(a.nbytes for a in arrays)
        put = functools.partial(self._put, tuple(block_hashes), run_lengths, nbytes, arrays)
        self._publishing.append(self._publisher.submit(put))
        self._counters["publishes"] += 1
        self._counters["bytes_published"] += nbytes

    def _put(
        self,
        block_hashes: tuple[int, ...],
        run_lengths: tuple[int, ...],
        nbytes: int,
        arrays: list[np.ndarray],
    ) -> None:
        """On the publisher thread: one put; the owner copies it, then this reference drops."""
        start_s = time.perf_counter()
        try:
            digests = row_digests(arrays)
            if faults.strike(faults.Fault.CORRUPT_POOL_ENTRY):
                arrays = [*arrays[:-1], faults.flipped(arrays[-1])]
            ref = ray.put(arrays)
            entry = PoolPublish(self._layout, block_hashes, [ref], run_lengths, nbytes, digests)
            self.pool.publish.remote(entry)
        except RayError as exc:  # a cache: the blocks are just not shared
            logger.warning("KV pool publish of %d blocks failed: %s", len(block_hashes), exc)
        self._publish_ms.add((time.perf_counter() - start_s) * 1e3)

    def _block_arrays(self) -> BlockArrays:
        if self._blocks is None:
            raise RuntimeError("register_kv_caches() must be called before moving KV")
        return self._blocks

    # ---- lifecycle --------------------------------------------------------------------------
    def shutdown(self) -> None:
        for rid in list(self._hits):
            self._drop_hit(rid)
        for load in [*self._new_loads, *self._inflight.values()]:
            self._release(load)
        self._new_loads.clear()
        self._inflight.clear()
        self._asking.clear()
        self._pooled.clear()
        self._failed.clear()
        self._loading.clear()
        self._publisher.shutdown(wait=True)  # the puts under way reach the pool
        self._publishing.clear()

    def stats(self) -> KVConnectorStats:
        use = KVPoolUse(
            **self._counters,
            pending_loads=len(self._inflight) + len(self._new_loads),
            load_ms_histogram=self._load_ms.histogram(),
            mean_load_ms=self._load_ms.mean,
            mean_publish_ms=self._publish_ms.mean,
        )
        return KVConnectorStats(kv_pool=use)
