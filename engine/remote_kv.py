"""The scheduler's remote-KV bookkeeping: requests parked while their KV loads from another
instance (or a cache), loads that ended after their request was aborted, loaded blocks to
publish after a step, and finished requests whose blocks a producer holds for a consumer.
No Ray here.

One `RemoteKV` serves one scheduler, which owns it and calls it; it holds the state above
and works through its collaborators only: the KV connector (what can be loaded, what was
sent, landed or failed) and the KV cache manager (the requests' blocks). The scheduler
keeps the queues and the request table and acts on what `update` returns.

Invariants:
- a parked request is WAITING_FOR_REMOTE_KVS and holds blocks for its whole prompt until its
  load lands (then WAITING, with the loaded tokens computed) or fails (recomputed here, or
  finished with an error under kv_load_failure_policy='fail');
- a request aborted while parked keeps its blocks until its load has landed or failed: the
  connector may still be writing into them;
- a producer's finished request keeps its blocks until the connector reports it in
  `finished_sending` (the consumer acked, the lease expired, or the send was cancelled), or
  it is aborted;
- a request asks the connector for remote KV at most until one load landed or failed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdcluster.connectors.base import KVConnectorBase, KVTransferParams
from pdcluster.engine.kv_cache_manager import KVCacheManager
from pdcluster.engine.outputs import KVConnectorOutput, SchedulerOutput
from pdcluster.engine.request import Request, RequestStatus


@dataclass
class KVEvents:
    """What the scheduler must do after the connector's report of one step."""

    # Requests whose blocks are no longer needed: a send ended, or an aborted load ended.
    to_free: list[Request] = field(default_factory=list)
    # Loads that failed under kv_load_failure_policy='fail': the request ends with its error
    # (status and error already set); it is still in `skipped_waiting`.
    failed: list[Request] = field(default_factory=list)


class RemoteKV:
    """Remote-KV state of one scheduler: loads in flight, aborted loads, delayed frees."""

    def __init__(
        self,
        connector: KVConnectorBase,
        kv_cache_manager: KVCacheManager,
        load_failure_policy: str = "recompute",
    ) -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        self.load_failure_policy = load_failure_policy
        self._loads: dict[str, int] = {}  # parked: num_computed_tokens once its load lands
        self._aborted_loads: set[str] = set()  # finished while loading: blocks held till it ends
        self._asked: set[str] = set()  # loaded or failed once: never asked again
        self._publish_after_step: list[Request] = []  # admitted with a synchronous load
        self._pending_sends: set[str] = set()  # producer: finished, blocks held until sent

    # ---- queries --------------------------------------------------------------------------
    @property
    def num_pending_sends(self) -> int:
        return len(self._pending_sends)

    @property
    def num_aborted_loads(self) -> int:
        return len(self._aborted_loads)

    def is_sending(self, request_id: str) -> bool:
        """Whether a finished request's blocks are held for a consumer."""
        return request_id in self._pending_sends

    def is_loading(self, request_id: str) -> bool:
        """Whether a request is parked (or was aborted while parked) until its load ends."""
        return request_id in self._loads

    def match(self, request: Request, num_computed: int) -> tuple[int | None, bool]:
        """(tokens beyond `num_computed` the connector can load, whether asynchronously);
        None: not known yet. (0, False) for a request that may not load: it holds blocks
        already (a landed load), was preempted, or loaded or failed once."""
        if (
            request.request_id in self.kv_cache_manager.req_to_blocks
            or request.num_preemptions
            or request.request_id in self._asked
        ):
            return 0, False
        return self.connector.get_num_new_matched_tokens(request, num_computed)

    # ---- scheduling -----------------------------------------------------------------------
    def park(
        self, request: Request, computed_blocks: list, num_computed: int, num_external: int
    ) -> bool:
        """Allocate blocks for the whole prompt (the remote tokens and the ones computed here
        after they land, so two landed loads can never wait on each other's blocks) and park
        the request until the remote tokens land. False when the blocks do not fit."""
        kv = self.kv_cache_manager
        num_local = request.num_tokens - num_computed - num_external
        if (
            kv.allocate_slots(request, num_local, num_computed, computed_blocks, num_external)
            is None
        ):
            return False
        block_ids = kv.get_block_ids(request.request_id)
        self.connector.update_state_after_alloc(request, block_ids, num_external)
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._loads[request.request_id] = num_computed + num_external
        return True

    def admitted(self, request: Request, num_external: int) -> None:
        """A request was scheduled with its blocks allocated; `num_external` tokens of it are
        loaded while the step runs (synchronously), and published once it ran."""
        if request.request_id not in self._asked:
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            self.connector.update_state_after_alloc(request, block_ids, num_external)
        if num_external:
            self._publish_after_step.append(request)

    def begin_step(self) -> None:
        """A new schedule(): the previous one never reached `update` when its step raised."""
        self._publish_after_step = []

    def publish_loaded_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """Publish the blocks of requests admitted with a synchronous load, which the step
        that just ran filled (the loaded tokens and the ones computed after them)."""
        ran = scheduler_output.num_scheduled_tokens
        for request in self._publish_after_step:
            if request.request_id in ran and request.status == RequestStatus.RUNNING:
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        self._publish_after_step = []

    # ---- finishing ------------------------------------------------------------------------
    def request_finished(self, request: Request) -> tuple[bool, KVTransferParams | None]:
        """The connector's (delay_free, kv_transfer_params) for a request that just finished;
        with delay_free its blocks are held until the connector reports it sent."""
        rid = request.request_id
        block_ids = self.kv_cache_manager.get_block_ids(rid)
        delay_free, params = self.connector.request_finished(request, block_ids)
        if delay_free:
            self._pending_sends.add(rid)
        return delay_free, params

    def abort_load(self, request_id: str) -> None:
        """A parked request was aborted: its blocks wait until its load has ended."""
        self._aborted_loads.add(request_id)

    def forget(self, request_id: str) -> None:
        """The request's blocks were freed and it left the scheduler."""
        self._loads.pop(request_id, None)
        self._asked.discard(request_id)
        self._pending_sends.discard(request_id)
        self._aborted_loads.discard(request_id)

    # ---- the connector's report -----------------------------------------------------------
    def update(self, kv_output: KVConnectorOutput, requests: Mapping[str, Request]) -> KVEvents:
        """Take one step's report: sends that ended, loads that failed, loads that landed."""
        events = KVEvents()
        for rid in kv_output.finished_sending:
            if rid in self._pending_sends:
                self._pending_sends.discard(rid)
                events.to_free.append(requests[rid])
        for rid in kv_output.failed_recving:
            self._on_load_ended(rid, requests, events, landed=False)
        for rid in kv_output.finished_recving:
            self._on_load_ended(rid, requests, events, landed=True)
        return events

    def _on_load_ended(
        self, rid: str, requests: Mapping[str, Request], events: KVEvents, landed: bool
    ) -> None:
        request = requests.get(rid)
        if rid in self._aborted_loads:
            self._aborted_loads.discard(rid)
            events.to_free.append(request)
            return
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return
        num_loaded = self._loads.pop(rid, 0)
        self._asked.add(rid)
        if landed:
            self._resume(request, num_loaded)
        elif self._recomputes(request):
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING  # stays in skipped_waiting, prefills here
        else:
            request.status = RequestStatus.FINISHED_ERROR
            request.error = (
                f"request {rid!r}: loading its KV cache from the prefill instance failed "
                "(kv_load_failure_policy='fail')"
            )
            events.failed.append(request)

    def _resume(self, request: Request, num_loaded: int) -> None:
        """The load landed: the request waits again with the loaded tokens computed, except
        the last prompt token when all were loaded (its logits are needed)."""
        request.num_computed_tokens = min(num_loaded, request.num_tokens - 1)
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.WAITING

    def _recomputes(self, request: Request) -> bool:
        return self.load_failure_policy == "recompute" or self.connector.load_failure_recomputes(
            request
        )
