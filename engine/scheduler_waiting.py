"""Admission of waiting requests, one step at a time: what each finds in the prefix cache and
the connectors, parking the ones whose KV loads asynchronously, and scheduling a chunk of the
others. No Ray here.

The scheduler owns one `WaitingAdmission` and hands it its collaborators: the queues
(`waiting`, `skipped_waiting`, `running`, the same objects the scheduler holds), the block
and encoder-cache managers, the EC connector and the remote-KV bookkeeping. Under fcfs,
skipped_waiting goes before waiting; under priority, whichever head has the smaller key.
"""

from __future__ import annotations

import time

from pdcluster.connectors.base import ECConnectorBase
from pdcluster.engine.config import SchedulerConfig
from pdcluster.engine.encoder_cache_manager import EncoderCacheManager
from pdcluster.engine.kv_cache_manager import KVCacheManager
from pdcluster.engine.outputs import NewRequestData
from pdcluster.engine.remote_kv import RemoteKV
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.request_queue import RequestQueue
from pdcluster.engine.scheduler_step import (
    Lookup,
    Outcome,
    StepState,
    commit_encoder_inputs,
    lookup,
    plan_encoder_inputs,
)


class WaitingAdmission:
    """Moves requests from `waiting` / `skipped_waiting` to `running` (or parks them)."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        encoder_cache_manager: EncoderCacheManager,
        ec_connector: ECConnectorBase | None,
        remote_kv: RemoteKV | None,
        waiting: RequestQueue,
        skipped_waiting: RequestQueue,
        running: list[Request],
        max_loras: int | None = None,
    ) -> None:
        self.config = config
        self.max_loras = max_loras
        self.kv_cache_manager = kv_cache_manager
        self.encoder_cache_manager = encoder_cache_manager
        self.ec_connector = ec_connector
        self.remote_kv = remote_kv
        self.waiting = waiting
        self.skipped_waiting = skipped_waiting
        self.running = running
        self.enc = (encoder_cache_manager, ec_connector)

    def park_remote_loads(self) -> bool:
        """Park the requests at the head of `waiting` whose KV the connector loads
        asynchronously, as `schedule` would; whether any was. Blocks go in the order
        `schedule` gives them: the pass stops at the first request that is not such a load,
        does nothing while a deferred request may still need blocks, and leaves one free
        block per running request (a decode needs at most one a step)."""
        if self.remote_kv is None or not self.waiting:
            return False
        kv = self.kv_cache_manager
        if any(r.request_id not in kv.req_to_blocks for r in self.skipped_waiting):
            return False
        parked = False
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek_request()
            found = self.lookup(request)
            if found is None or not found.parks:
                break
            num_blocks = -(-request.num_tokens // kv.block_size) - len(found.computed_blocks)
            if kv.get_num_free_blocks() - num_blocks < len(self.running) or not self.park(
                request, found
            ):
                break
            self.skipped_waiting.add_request(self.waiting.pop_request())
            parked = True
        return parked

    def schedule(self, st: StepState) -> None:
        """Admit waiting requests in policy order while the step's budgets allow."""
        max_num_seqs = self.config.max_num_seqs
        loras = {r.lora_request for r in self.running if r.lora_request is not None}
        while (self.skipped_waiting or self.waiting) and st.token_budget > 0:
            if len(self.running) >= max_num_seqs:
                break
            waiting, skipped = self.waiting, self.skipped_waiting
            queue = (
                waiting if waiting and (not skipped or waiting.goes_before(skipped)) else skipped
            )
            request = queue.peek_request()
            lora = request.lora_request
            if lora is not None and lora not in loras and len(loras) >= (self.max_loras or 0):
                outcome = Outcome.SKIP  # its adapter waits for a slot: max_loras are running
            else:
                outcome = self._try(request, st)
            if outcome is Outcome.STOP:
                break
            queue.pop_request()
            if outcome is Outcome.SKIP:
                st.step_skipped.append(request)
            elif outcome is Outcome.SCHEDULED and lora is not None:
                loras.add(lora)
        self.skipped_waiting.prepend_requests(st.step_skipped)

    def _try(self, request: Request, st: StepState) -> Outcome:
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return Outcome.SKIP
        found = self.lookup(request)
        if found is None:
            return Outcome.SKIP
        if found.parks:
            return Outcome.SKIP if self.park(request, found) else Outcome.STOP
        return self._admit(request, found, st)

    def lookup(self, request: Request) -> Lookup | None:
        return lookup(request, self.kv_cache_manager, self.remote_kv, self.ec_connector)

    def park(self, request: Request, found: Lookup) -> bool:
        """Blocks for the whole prompt, then WAITING_FOR_REMOTE_KVS until the load lands."""
        return self.remote_kv.park(
            request, found.computed_blocks, found.num_computed, found.num_external
        )

    def _admit(self, request: Request, found: Lookup, st: StepState) -> Outcome:
        """Schedule a waiting request's next chunk: encoder inputs, blocks, bookkeeping."""
        start = found.num_computed + found.num_external
        num_new = min(request.num_tokens - start, st.token_budget)
        enc = None
        if request.mm_features:
            enc = plan_encoder_inputs(request, start, num_new, st, *self.enc)
            num_new = enc.num_new
        kv = self.kv_cache_manager
        new_blocks = None
        if num_new > 0:
            num_hit = found.num_computed - request.num_computed_tokens  # 0 after a remote load
            new_blocks = kv.allocate_slots(
                request, num_new, num_hit, found.computed_blocks, found.num_external
            )
        if new_blocks is None:
            self.encoder_cache_manager.free(request)  # references taken while planning
            return Outcome.STOP
        if enc is not None:
            commit_encoder_inputs(request, enc, st, *self.enc)
        if self.remote_kv is not None:
            self.remote_kv.admitted(request, found.num_external)
        if not found.num_external:  # else loaded while the step runs: published once it ran
            kv.cache_blocks(request, start + num_new)
        request.num_computed_tokens = start
        if request.num_cached_tokens < 0:  # first scheduled
            request.num_cached_tokens = start
            request.queue_time_s = time.monotonic() - request.queued_time
        self._record_admitted(request, st)
        st.record(request, num_new)
        return Outcome.SCHEDULED

    def _record_admitted(self, request: Request, st: StepState) -> None:
        rid = request.request_id
        block_ids = self.kv_cache_manager.get_block_ids(rid)
        if request.status == RequestStatus.PREEMPTED:
            st.add_cached(rid, True, block_ids, request.num_computed_tokens)
        else:
            connector = None if self.remote_kv is None else self.remote_kv.connector
            params = request.kv_transfer_params
            st.new_reqs.append(
                NewRequestData(
                    rid,
                    request.prompt_token_ids,
                    request.mm_features,
                    request.sampling_params,
                    block_ids,
                    request.num_computed_tokens,
                    request.num_prior_output_tokens,
                    connector.take_loaded_draft_tokens(rid) if connector is not None else 0,
                    params is not None and params.do_remote_decode,
                    request.lora_request,
                )
            )
        request.status = RequestStatus.RUNNING
        self.running.append(request)
