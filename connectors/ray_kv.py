"""KV connector over Ray's object store.

Producer (prefill): when a `do_remote_decode` request finishes, its prompt blocks are published
with ONE `ray.put` of NumPy views over runs of consecutive block ids of the pool, held until
the consumer acks, the lease expires, or the send is cancelled (connectors/ray_kv_producer.py).

Consumer (decode): the load is started without blocking (the fetch is kicked and a future
awaits it); once the object is local, its zero-copy views are copied straight into the
request's own blocks (the only copy on D), the producer is acked, and every reference to the
object is dropped. An object already in this node's store (always so on one node: P's put
finished before D heard of it) needs no transfer: its future resolves within `start_load_kv`,
so the load lands at the very next `get_finished`.

The handoff is one `KVTransferParams` whose handle is a `RayKVHandle`: the object's ref, its
run lengths (blocks per array of the object, in source block order: source block i lives in
the array whose runs cover i), the block shape, dtype and size. Params a consumer cannot read
fail the load with a `KVLoadError`, which is logged and reported through `get_failed_loads`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
import torch
from ray.exceptions import RayError

from pdcluster.connectors import faults
from pdcluster.connectors.base import (
    HeadShardedKV,
    KVConnectorBase,
    KVLoadError,
    KVTransferParams,
    new_epoch,
)
from pdcluster.connectors.checksum import ChecksumError
from pdcluster.connectors.ray_kv_acks import AckSender, ActorAckSender
from pdcluster.connectors.ray_kv_layout import (
    BlockArrays,
    Latency,
    RayKVConnectorMetadata,
    RayKVHandle,
    RayKVLoad,
    checked_handle,
    plan_segments,
)
from pdcluster.connectors.ray_kv_producer import RayKVProducer
from pdcluster.connectors.stats import KVConnectorStats, KVTransferStats
from pdcluster.engine.request import Request

logger = logging.getLogger(__name__)

ROLES = ("producer", "consumer", "both")
_LOAD_COUNTERS = (  # KVTransferStats fields
    "num_loads",
    "num_failed_loads",
    "checksum_failures",
    "bytes_received",
)

# How long start_load_kv waits for the futures of objects already in this node's store: they
# resolve in well under 1 ms; the bound only keeps a surprise from stalling the step loop.
LOCAL_RESOLVE_TIMEOUT_S = 0.1


class RayKVConnector(KVConnectorBase):
    """P->D KV handoff through the Ray object store; one object serves one instance.

    Checked (connectors/checksum.py): the producer hashes every block it publishes, the
    consumer checks each block as it copies it in; a mismatch fails the load closed and the
    request is recomputed here whatever `kv_load_failure_policy` says. `epoch` names this
    incarnation of the instance (a fresh one by default) in its handles and their acks."""

    def __init__(
        self,
        engine_id: str,
        role: str,
        block_size: int,
        lease_s: float = 60.0,
        load_timeout_s: float = 60.0,
        ack_sender: AckSender | None = None,
        clock: Callable[[], float] = time.perf_counter,
        epoch: str | None = None,
        checksum: bool = True,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if block_size < 1 or lease_s <= 0 or load_timeout_s <= 0:
            raise ValueError("block_size, lease_s and load_timeout_s must be positive")
        self.engine_id = engine_id
        self.role = role
        self.block_size = block_size
        self.lease_s = lease_s
        self.load_timeout_s = load_timeout_s
        self.epoch = new_epoch() if epoch is None else epoch
        self._ack_sender = ack_sender or ActorAckSender()
        self._clock = clock  # times loads (and their modeled arrival)
        self._transfer_s: Callable[[int], float] | None = None
        self._blocks: BlockArrays | None = None  # the KV pool, once registered
        # Producer: blocks stay referenced until the consumer acks or the lease expires.
        self._producer = RayKVProducer(
            engine_id, block_size, lease_s, self._block_arrays, self.epoch, checksum
        )
        # Consumer: a request id is claimed from allocation until it finishes here.
        self._claimed: set[str] = set()
        self._new_loads: list[RayKVLoad] = []
        self._inflight: dict[str, RayKVLoad] = {}
        self._failed: set[str] = set()
        self._corrupt: set[str] = set()  # failed a checksum: recomputed whatever the policy
        self._draft_loaded: dict[str, int] = {}  # landed with draft KV: its tokens
        self._counters = dict.fromkeys(_LOAD_COUNTERS, 0)
        self._load_ms = Latency()  # start_load_kv -> copied into our blocks

    @property
    def is_producer(self) -> bool:
        return self.role in ("producer", "both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("consumer", "both")

    # ---- worker side: pool ---------------------------------------------------------------
    def register_kv_caches(
        self, kv_caches: torch.Tensor, draft_kv_cache: torch.Tensor | None = None
    ) -> None:
        self._blocks = BlockArrays(kv_caches, self.block_size, draft_kv_cache)

    def register_head_shards(self, shards: HeadShardedKV) -> None:
        self._block_arrays().use_head_shards(shards)  # whole blocks, whatever either side's TP

    def set_modeled_transfer(self, transfer_s: Callable[[int], float]) -> None:
        self._transfer_s = transfer_s

    def _block_arrays(self) -> BlockArrays:
        if self._blocks is None:
            raise RuntimeError("register_kv_caches() must be called before moving KV")
        return self._blocks

    # ---- producer (RayKVProducer) ---------------------------------------------------------
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        self._claimed.discard(request.request_id)
        self._corrupt.discard(request.request_id)
        self._draft_loaded.pop(request.request_id, None)
        if not self.is_producer:
            return False, None
        return self._producer.request_finished(request, block_ids)

    def ack(self, request_id: str, epoch: str) -> None:
        """The consumer has read `request_id` of incarnation `epoch` (see RayKVProducer.ack).
        Thread-safe: called from the actor's RPC thread."""
        self._producer.ack(request_id, epoch)

    def has_pending(self) -> bool:
        return bool(self._producer.num_pending) or self.needs_polling()

    def needs_polling(self) -> bool:
        loads = self._new_loads or self._inflight or self._failed
        return self._producer.has_released or bool(loads)

    def cancel_sends(self, request_ids: set[str] | list[str]) -> None:
        """Aborted on P before the consumer read: the objects are dropped now and the requests
        are reported at the next get_finished. Unknown ids are ignored. Thread-safe."""
        self._producer.cancel(request_ids)

    # ---- consumer: scheduler side ----------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.is_consumer or request.request_id in self._claimed:
            return 0, False
        try:
            handle = self._remote_handle(request)
        except KVLoadError:  # allocate a token so that the failure is reported
            return max(1, request.num_tokens - 1 - num_computed_tokens), True
        if handle is None:
            return 0, False
        params = request.kv_transfer_params
        num_new = params.num_tokens - num_computed_tokens
        if num_new > 0:
            return num_new, True
        # Our prefix cache already holds every token P computed: nothing to read, so let P
        # free its blocks now rather than at its lease.
        self._claimed.add(request.request_id)
        request.kv_transfer_params = params.released()
        self._ack(request.request_id, params, handle.epoch)
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        if num_external_tokens <= 0 or not self.is_consumer or rid in self._claimed:
            return
        try:
            handle = self._remote_handle(request)
            if handle is None:
                return
            self._claimed.add(rid)
            self._new_loads.append(self._plan_load(request, handle, block_ids, num_external_tokens))
        except KVLoadError as e:
            self._claimed.add(rid)
            self._fail(rid, e)
        # The load now holds the only reference on this side; the request keeps its params.
        request.kv_transfer_params = request.kv_transfer_params.released()

    def _remote_handle(self, request: Request) -> RayKVHandle | None:
        """The checked handle of a request that reads its prompt's KV from a producer; None
        for any other request. KVLoadError when its params cannot be read."""
        params = request.kv_transfer_params
        if params is None or not params.do_remote_prefill:
            return None
        if params.handle is None:
            logger.warning("request %r: do_remote_prefill without a handle", request.request_id)
            return None
        return checked_handle(params, request, self.block_size, self._expected_layout())

    def _expected_layout(self) -> tuple[tuple[int, ...], str] | None:
        return None if self._blocks is None else self._blocks.layout

    def _plan_load(
        self, request: Request, handle: RayKVHandle, block_ids: list[int], num_external: int
    ) -> RayKVLoad:
        """Map the source blocks of tokens [start, num_tokens) onto this request's blocks."""
        params = request.kv_transfer_params
        num_tokens = params.num_tokens
        start = num_tokens - num_external  # tokens already computed here (whole blocks)
        if start < 0 or start % self.block_size:
            raise KVLoadError(f"remote load starts at token {start}, not at a block boundary")
        first, end = start // self.block_size, -(-num_tokens // self.block_size)
        if len(block_ids) < end:
            raise KVLoadError(f"{len(block_ids)} blocks allocated, {end} needed")
        segments = plan_segments(handle.run_lengths, first, list(block_ids[first:end]))
        nbytes = handle.nbytes * (end - first) // handle.num_blocks
        # The draft's KV is taken whole only: a prefix from our own cache may hold a draft KV
        # that was never computed (its request never drafted), so a load after it catches up.
        ours = None if self._blocks is None else self._blocks.draft_layout
        with_draft = start == 0 and handle.draft_layout is not None and handle.draft_layout == ours
        return RayKVLoad(
            request.request_id,
            params.remote_engine_id,
            params.remote_request_id,
            handle.ref,
            segments,
            nbytes,
            num_tokens=num_external,
            num_runs=len(handle.run_lengths),
            num_draft_tokens=num_tokens if with_draft else 0,
            digests=handle.digests,
            remote_epoch=handle.epoch,
        )

    def build_connector_meta(self, scheduler_output: Any) -> RayKVConnectorMetadata:
        meta = RayKVConnectorMetadata(self._new_loads)
        self._new_loads = []
        return meta

    # ---- consumer: worker side -------------------------------------------------------------
    def start_load_kv(self, metadata: Any) -> None:
        """Kick the fetch of every new load. Never waits for a transfer: only for the
        futures of objects already in this node's store to resolve (a fraction of a ms)."""
        if not isinstance(metadata, RayKVConnectorMetadata) or not metadata.loads:
            return
        refs = list(dict.fromkeys(load.ref for load in metadata.loads))
        local = set(ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=True)[0])
        now = self._clock()
        for load in metadata.loads:
            load.started_s = load.ready_s = now
            if self._transfer_s is not None:
                load.ready_s = now + self._transfer_s(load.num_tokens)
            if delay := faults.strike(faults.Fault.DELAY_LOAD):
                load.ready_s = now + delay.seconds
            load.future = load.ref.future()  # resolves to the views, or to the fetch's error
            self._inflight[load.request_id] = load
        local_futures = [load.future for load in metadata.loads if load.ref in local]
        concurrent.futures.wait(local_futures, timeout=LOCAL_RESOLVE_TIMEOUT_S)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        finished_sending = self._producer.collect_finished() if self.is_producer else set()
        finished_recving: set[str] = set()
        now = self._clock()
        for rid, load in list(self._inflight.items()):
            if load.future.done():
                if now >= load.ready_s:  # a modeled link's transfer has also finished
                    del self._inflight[rid]
                    if self._land(load):
                        finished_recving.add(rid)
            elif now - load.started_s > self.load_timeout_s:
                del self._inflight[rid]
                load.future = load.ref = None
                self._fail(rid, KVLoadError(f"no result within {self.load_timeout_s} s"))
        return finished_sending, finished_recving

    def _land(self, load: RayKVLoad) -> bool:
        """Copy a fetched object into the request's blocks and ack; False when it failed. A
        checksum mismatch is acked too: nothing more will be read from that object."""
        try:
            arrays = load.future.result()
            with_draft = load.num_draft_tokens > 0
            self._block_arrays().copy_in(
                arrays, load.segments, load.num_runs, with_draft, load.digests
            )
        except ChecksumError as e:
            self._counters["checksum_failures"] += 1
            self._corrupt.add(load.request_id)
            self._fail(load.request_id, e)
            self._ack(load.request_id, load, load.remote_epoch)
            return False
        except (RayError, ValueError, TypeError, IndexError, RuntimeError) as e:
            self._fail(load.request_id, KVLoadError(f"{type(e).__name__}: {e}"))
            return False
        finally:
            load.future = load.ref = arrays = None  # drop every reference to the object
        self._load_ms.add((self._clock() - load.started_s) * 1e3)
        self._counters["num_loads"] += 1
        self._counters["bytes_received"] += load.nbytes
        if load.num_draft_tokens:
            self._draft_loaded[load.request_id] = load.num_draft_tokens
        self._ack(load.request_id, load, load.remote_epoch)
        return True

    def knows_producer(self, engine_id: str) -> bool:
        """Whether an ack to producer `engine_id` needs no lookup by name."""
        sender = self._ack_sender
        return not isinstance(sender, ActorAckSender) or sender.knows(engine_id)

    def find_producer(self, engine_id: str) -> None:
        """Look up a producer `knows_producer` does not know (blocking while Ray's GCS is
        down: the instance calls this off its step thread, as a request arrives, so that the
        ack never waits on the GCS). One that is gone is no error here: its ack fails."""
        sender = self._ack_sender
        if isinstance(sender, ActorAckSender):
            with contextlib.suppress(ValueError):
                sender.find(engine_id)

    def _ack(self, request_id: str, source: RayKVLoad | KVTransferParams, epoch: str) -> None:
        """Tell the producer its object was read (at once, or late under a DELAY_ACK fault)."""
        engine_id, remote_id = source.remote_engine_id, source.remote_request_id
        if delay := faults.strike(faults.Fault.DELAY_ACK):
            timer = threading.Timer(
                delay.seconds, self._send_ack, (request_id, engine_id, remote_id, epoch)
            )
            timer.daemon = True
            timer.start()
            return
        self._send_ack(request_id, engine_id, remote_id, epoch)

    def _send_ack(self, request_id: str, engine_id: str, remote_id: str, epoch: str) -> None:
        try:
            self._ack_sender(engine_id, remote_id, epoch)
        except Exception as e:  # the producer's lease frees its blocks without the ack
            logger.warning("request %r: ack to %r failed: %s", request_id, engine_id, e)

    def _fail(self, request_id: str, error: KVLoadError) -> None:
        logger.warning("request %r: remote KV load failed: %s", request_id, error)
        self._failed.add(request_id)
        self._counters["num_failed_loads"] += 1

    def load_failure_recomputes(self, request: Request) -> bool:
        """A load that failed its checksum is recomputed: corrupt bytes are never served,
        nor is the client's request failed for them."""
        return request.request_id in self._corrupt

    def take_loaded_draft_tokens(self, request_id: str) -> int:
        """Tokens of `request_id` whose draft KV landed with the target's (once)."""
        return self._draft_loaded.pop(request_id, 0)

    def get_failed_loads(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed

    # ---- lifecycle -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Drop every reference this connector holds; nothing is reported afterwards."""
        self._new_loads.clear()
        self._inflight.clear()
        self._failed.clear()
        self._corrupt.clear()
        self._claimed.clear()
        self._draft_loaded.clear()
        self._producer.clear()

    def stats(self) -> KVConnectorStats:
        transfer = KVTransferStats(
            **self._producer.counters,
            **self._counters,
            last_transfer_ms=self._load_ms.last,
            mean_transfer_ms=self._load_ms.mean,
            transfer_ms_histogram=self._load_ms.histogram(),
            last_publish_ms=self._producer.publish_ms.last,
            mean_publish_ms=self._producer.publish_ms.mean,
        )
        return KVConnectorStats(
            kv_transfer=transfer,
            num_pending_sends=self._producer.num_pending,
            num_pending_recvs=len(self._inflight) + len(self._new_loads),
        )
