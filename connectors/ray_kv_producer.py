"""The producer side of the Ray KV connector (connectors/ray_kv.py): a finished prefill's
prompt blocks published with ONE `ray.put` of NumPy views over runs of consecutive block ids
(no gather copy; the put is the only copy on P). The object reference and the blocks stay
held until the consumer acks, the lease expires, or the send is cancelled."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray

from pdcluster.connectors import faults
from pdcluster.connectors.base import KVTransferParams
from pdcluster.connectors.checksum import row_digests
from pdcluster.connectors.ray_kv_layout import BlockArrays, Latency, RayKVHandle
from pdcluster.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)

_SENDABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
SEND_COUNTERS = (  # KVTransferStats fields
    "num_sends",
    "leases_expired",
    "acks_received",
    "acks_ignored",
    "acks_refused",
    "sends_cancelled",
    "bytes_sent",
)


@dataclass
class _PendingSend:
    ref: ray.ObjectRef
    deadline_s: float
    nbytes: int


class RayKVProducer:
    """One instance's published KV. `ack` and `cancel` are thread-safe: they come from the
    actor's RPC threads while the step loop publishes and collects.

    Each handle carries a checksum of every block (connectors/checksum.py) unless `checksum`
    is off, and this incarnation's `epoch`: an ack naming another epoch (one meant for a
    predecessor under the same name) is refused and counted, never applied."""

    def __init__(
        self,
        engine_id: str,
        block_size: int,
        lease_s: float,
        block_arrays: Callable[[], BlockArrays],
        epoch: str,
        checksum: bool = True,
    ) -> None:
        self.engine_id = engine_id
        self.epoch = epoch
        self.checksum = checksum
        self.block_size = block_size
        self.lease_s = lease_s
        self._block_arrays = block_arrays  # the KV pool (raises until it is registered)
        self._sends: dict[str, _PendingSend] = {}
        self._released: set[str] = set()  # acked or cancelled, not yet reported
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(SEND_COUNTERS, 0)
        self.publish_ms = Latency()

    @property
    def num_pending(self) -> int:
        """Sends whose object is still held: not acked, cancelled or expired."""
        return len(self._sends)

    @property
    def has_released(self) -> bool:
        """Sends acked or cancelled that the next `collect_finished` reports."""
        return bool(self._released)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        """Publish a finished `do_remote_decode` request's computed blocks: (True, the
        consumer's params), the blocks then held until the send finishes; else (False, None)."""
        if request.status not in _SENDABLE:
            return False, None
        params = request.kv_transfer_params
        if params is None or not params.do_remote_decode:
            return False, None
        num_tokens = request.num_computed_tokens
        num_blocks = -(-num_tokens // self.block_size)
        if num_tokens <= 0 or len(block_ids) < num_blocks:
            logger.warning(
                "request %r: %d blocks cannot hold %d computed tokens; KV not published",
                request.request_id,
                len(block_ids),
                num_tokens,
            )
            return False, None
        handle = self._publish(request.request_id, list(block_ids[:num_blocks]))
        return True, KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.engine_id,
            remote_request_id=request.request_id,
            num_tokens=num_tokens,
            handle=handle,
        )

    def _publish(self, request_id: str, block_ids: list[int]) -> RayKVHandle:
        """One ray.put of the blocks' runs; the ref is held until ack, lease or cancel."""
        blocks = self._block_arrays()
        start_s = time.perf_counter()
        arrays, run_lengths = blocks.runs(block_ids)
        digests = row_digests(arrays) if self.checksum else None
        if faults.strike(faults.Fault.CORRUPT_KV):
            arrays = [*arrays[:-1], faults.flipped(arrays[-1])]
        ref = ray.put(arrays)
        nbytes = sum(a.nbytes for a in arrays)
        self.publish_ms.add((time.perf_counter() - start_s) * 1e3)
        with self._lock:
            if request_id in self._sends:
                logger.warning("request %r published twice; first copy dropped", request_id)
            self._sends[request_id] = _PendingSend(ref, time.monotonic() + self.lease_s, nbytes)
            self.counters["num_sends"] += 1
            self.counters["bytes_sent"] += nbytes
        return RayKVHandle(
            ref,
            run_lengths,
            blocks.block_shape,
            blocks.dtype,
            nbytes,
            blocks.draft_layout,
            digests,
            self.epoch,
        )

    def ack(self, request_id: str, epoch: str) -> None:
        """The consumer has read `request_id` as published by incarnation `epoch`: the object
        is dropped now, the blocks are released at the next collect_finished. Late (after the
        lease), duplicate and unknown acks are counted and ignored; an ack for another epoch
        is refused."""
        with self._lock:
            self.counters["acks_received"] += 1
            if epoch != self.epoch:
                self.counters["acks_refused"] += 1
                logger.warning(
                    "request %r: ack for epoch %r refused (this is %r)",
                    request_id,
                    epoch,
                    self.epoch,
                )
                return
            if self._sends.pop(request_id, None) is None:
                self.counters["acks_ignored"] += 1
            else:
                self._released.add(request_id)

    def cancel(self, request_ids: set[str] | list[str]) -> None:
        """Aborted before the consumer read: the objects are dropped now and the requests
        reported at the next collect_finished. Unknown ids are ignored."""
        with self._lock:
            for request_id in request_ids:
                if self._sends.pop(request_id, None) is not None:
                    self._released.add(request_id)
                    self.counters["sends_cancelled"] += 1

    def collect_finished(self) -> set[str]:
        """Released since the last call, plus sends whose lease ran out (their refs dropped)."""
        now = time.monotonic()
        with self._lock:
            done, self._released = self._released, set()
            expired = [rid for rid, send in self._sends.items() if send.deadline_s <= now]
            for request_id in expired:
                del self._sends[request_id]
            self.counters["leases_expired"] += len(expired)
        for request_id in expired:
            logger.warning("request %r: KV lease expired before the consumer acked", request_id)
        return done.union(expired)

    def clear(self) -> None:
        """Drop every reference held; nothing is reported afterwards."""
        with self._lock:
            self._sends.clear()
            self._released.clear()
