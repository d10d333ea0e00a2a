"""The scheduler of one instance: token budget, chunked prefill, preemption, encoder
admission and the KV / EC connector hooks. No model and no Ray here.

Queues: `running` (scheduled last step, decode or mid-prefill), `skipped_waiting` (requests
passed over by an earlier step: deferred by the EC connector, unknown to the KV connector,
or parked in WAITING_FOR_REMOTE_KVS holding blocks) and `waiting`. Each step serves running
first, then the waiting queues. The scheduling policy orders them (engine.request_queue):
under fcfs, skipped_waiting before waiting, each in arrival order, and a preempted request
goes to the front of `waiting`; under priority, whichever queue's head has the smaller
(priority, arrival) key, `running` is served in that order too, and so its tail, the one
preempted when blocks run out, is the worst-priority request (vLLM's rule). A
pass ahead of that (`schedule_remote_loads`) parks new remote-KV requests so that their loads
start, and may land, before the step's batch is chosen. With a KV connector, a `RemoteKV`
(engine.remote_kv) keeps the remote-KV state: parked loads, aborted loads, delayed frees.

Each step a request's `num_computed_tokens` advances by its scheduled tokens when it is
scheduled; `update_from_output` appends sampled tokens and checks stop conditions. With
speculative decoding (engine.spec_decode.speculation), a decode request may be scheduled with
draft tokens (`scheduled_spec_decode_tokens`); after verification it steps back over the
rejected ones and gives back their blocks.

Prefix blocks are published when scheduled: the full blocks a request's scheduled tokens
cover enter the prefix cache at once, so a request admitted later in the same step hits them.
That is safe because a step is one forward pass and every attention layer writes all the
step's new K/V before it reads any block (`engine.attention.paged_attention`): a hit on a block
computed this step reads K/V written earlier in the same layer call. A failed step leaves them
published; the engine core's `fail_all` forgets every prefix. Blocks whose KV the connector
loads are published only once it landed: after the load (async) or after the step (sync).

Runner protocol: a request is sent once in full (`scheduled_new_reqs`), then as deltas
(`scheduled_cached_reqs`; `new_block_ids` None when no block was added). A preempted request
keeps its runner-side state (token ids) and comes back with `resumed_from_preemption` and its
whole block table; a finished one is named once in `finished_req_ids`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from pdcluster.connectors.base import ECConnectorBase, KVConnectorBase, KVTransferParams
from pdcluster.engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pdcluster.engine.encoder_cache_manager import EncoderCacheManager
from pdcluster.engine.kv_cache_manager import KVCacheManager
from pdcluster.engine.outputs import (
    EngineCoreOutput,
    KVConnectorOutput,
    RunnerOutput,
    SchedulerOutput,
)
from pdcluster.engine.remote_kv import RemoteKV
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.request_queue import RequestQueue, create_request_queue, priority_key
from pdcluster.engine.scheduler_output import (
    add_prompt_logprobs,
    append_tokens,
    load_failed_output,
)
from pdcluster.engine.scheduler_step import (
    StepState,
    check_mm_fits,
    commit_encoder_inputs,
    free_consumed_encoder_inputs,
    load_figures,
    plan_encoder_inputs,
)
from pdcluster.engine.scheduler_waiting import WaitingAdmission
from pdcluster.engine.spec_decode.speculation import Speculation


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_connector: KVConnectorBase | None = None,
        ec_connector: ECConnectorBase | None = None,
        speculative_config: SpeculativeConfig | None = None,
        max_loras: int | None = None,  # LoRA: adapters of one step's running requests at most
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.kv_connector = kv_connector
        self.ec_connector = ec_connector
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager(
            cache_config, enable_caching=scheduler_config.enable_prefix_caching
        )
        self.encoder_cache_manager = EncoderCacheManager(scheduler_config.encoder_cache_size)
        self._enc = (self.encoder_cache_manager, ec_connector)
        self.speculation = (
            None
            if speculative_config is None
            else Speculation(speculative_config, self.kv_cache_manager, self.max_model_len)
        )

        self.policy = scheduler_config.scheduling_policy
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = create_request_queue(self.policy)
        self.skipped_waiting: RequestQueue = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.remote_kv = (
            None
            if kv_connector is None
            else RemoteKV(
                kv_connector, self.kv_cache_manager, scheduler_config.kv_load_failure_policy
            )
        )
        self.admission = WaitingAdmission(
            scheduler_config, self.kv_cache_manager, self.encoder_cache_manager, ec_connector,
            self.remote_kv, self.waiting, self.skipped_waiting, self.running, max_loras,
        )  # fmt: skip
        # Since start, across all requests: preemptions, prompt tokens of requests that
        # produced their first token here, tokens generated.
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    # ---- intake and queries -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens, "
                f"more than max_model_len={self.max_model_len}"
            )
        if request.priority and self.policy != "priority":
            raise ValueError(
                f"priority: got {request.priority}, but this instance schedules first come, "
                "first served (scheduling_policy 'fcfs')"
            )
        check_mm_fits(request, self.scheduler_config, self.ec_connector is not None)
        request.queued_time = time.monotonic()
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.skipped_waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        """Finished requests the runner has not been told about, or whose blocks still
        await a delayed free (producer) or an in-flight load (aborted consumer)."""
        return bool(self.finished_req_ids) or (
            len(self.requests) > self.get_num_unfinished_requests()
        )

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests()

    def stats(self) -> dict[str, int]:
        kv, remote = self.kv_cache_manager, self.remote_kv
        parked = RequestStatus.WAITING_FOR_REMOTE_KVS
        return {
            "num_blocks_total": kv.num_blocks_total,
            "num_blocks_free": kv.get_num_free_blocks(),
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_deferred": len(self.skipped_waiting),
            "num_pending_sends": 0 if remote is None else remote.num_pending_sends,
            "num_pending_recvs": sum(1 for r in self.skipped_waiting if r.status == parked)
            + (0 if remote is None else remote.num_aborted_loads),
            "num_preemptions": self.num_preemptions,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "prefix_cache_queries": kv.num_prefix_queries,
            "prefix_cache_hits": kv.num_prefix_hits,
            "num_encoder_cache_refs": self.encoder_cache_manager.num_referenced_entries(),
            **load_figures(self.requests.values(), self.max_model_len),
        }

    # ---- schedule ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.scheduler_config
        st = StepState(cfg.max_num_batched_tokens, cfg.encoder_compute_budget)
        if self.remote_kv is not None:
            self.remote_kv.begin_step()
        self._schedule_running(st)
        if not st.preempted_req_ids:
            self.admission.schedule(st)
        return self._make_output(st)

    def schedule_remote_loads(self) -> SchedulerOutput | None:
        """A pass ahead of `schedule()` that schedules no token: it parks the requests at the
        head of `waiting` whose KV the connector loads asynchronously, just as `schedule()`
        would, and returns an empty SchedulerOutput carrying their loads (None when there
        were none; see `WaitingAdmission.park_remote_loads`). The engine core starts them at
        once, so a load whose data is already on this node lands in time for this step's
        `schedule()` to run its request, one step sooner."""
        if not self.admission.park_remote_loads():
            return None
        return self._attach_connector_meta(SchedulerOutput.empty())

    def _schedule_running(self, st: StepState) -> None:
        running = self.running
        if self.policy == "priority":
            running.sort(key=priority_key)  # stable: admission order among equal keys
        kv = self.kv_cache_manager
        allocate = kv.allocate_slots
        block_size = kv.block_size if kv.enable_caching else 0
        num_scheduled = st.num_scheduled_tokens
        budget = st.token_budget
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            i += 1
            num_computed = request.num_computed_tokens
            num_new = request.num_tokens - num_computed
            if num_new > budget:
                num_new = budget
            enc = None
            if request.mm_features:
                enc = plan_encoder_inputs(request, num_computed, num_new, st, *self._enc)
                num_new = enc.num_new
                if num_new <= 0:
                    continue
            drafts = self._draft_tokens(request, budget)
            new_blocks = allocate(request, num_new + len(drafts))
            if new_blocks is None and drafts:  # no room for the drafts: decode without them
                drafts = []
                new_blocks = allocate(request, num_new)
            if new_blocks is None:
                new_blocks = self._allocate_or_preempt(request, num_new, st)
                if new_blocks is None:  # the request itself was preempted
                    break
            if enc is not None:
                commit_encoder_inputs(request, enc, st, *self._enc)
            rid = request.request_id
            new_block_ids = [b.block_id for b in new_blocks] if new_blocks else None
            num_trimmed = self.speculation.take_num_trimmed_blocks(rid) if self.speculation else 0
            st.add_cached(rid, False, new_block_ids, num_computed, num_trimmed)
            if drafts:
                st.spec_decode_tokens[rid] = drafts
                num_new += len(drafts)
            num_scheduled[rid] = num_new
            request.num_computed_tokens = num_computed + num_new
            if block_size and (num_computed + num_new) // block_size != num_computed // block_size:
                kv.cache_blocks(request, num_computed + num_new)  # a block fills this step
            budget -= num_new
        st.total_num_scheduled_tokens += st.token_budget - budget
        st.token_budget = budget

    def _draft_tokens(self, request: Request, budget: int) -> list[int]:
        """Drafts to verify with a decode request's next token (none mid-prefill)."""
        if self.speculation is None or request.num_tokens - request.num_computed_tokens != 1:
            return []
        return self.speculation.draft_tokens(request, len(self.running), budget - 1)

    def _allocate_or_preempt(self, request: Request, num_new: int, st: StepState) -> list | None:
        """Blocks for num_new more tokens of a running request, preempting from the tail of
        `running` until they fit. None when `request` itself had to go."""
        allocate = self.kv_cache_manager.allocate_slots
        while True:
            new_blocks = allocate(request, num_new)
            if new_blocks is not None:
                return new_blocks
            victim = self.running.pop()
            self._preempt(victim, st)
            if victim is request:
                return None

    def _preempt(self, request: Request, st: StepState) -> None:
        """Recompute-style preemption: drop blocks and encoder inputs, keep output tokens."""
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self.speculation is not None:  # its whole block table is resent
            self.speculation.take_num_trimmed_blocks(request.request_id)
        self.waiting.prepend_request(request)
        st.preempted_req_ids.add(request.request_id)

    def _make_output(self, st: StepState) -> SchedulerOutput:
        out = SchedulerOutput(
            scheduled_new_reqs=st.new_reqs,
            scheduled_cached_reqs=st.cached_reqs,
            num_scheduled_tokens=st.num_scheduled_tokens,
            total_num_scheduled_tokens=st.total_num_scheduled_tokens,
            scheduled_encoder_inputs=st.encoder_inputs,
            finished_req_ids=self.finished_req_ids,
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
            preempted_req_ids=st.preempted_req_ids,
            scheduled_spec_decode_tokens=st.spec_decode_tokens,
        )
        self.finished_req_ids = set()
        return self._attach_connector_meta(out)

    def _attach_connector_meta(self, out: SchedulerOutput) -> SchedulerOutput:
        if self.kv_connector is not None:
            out.kv_connector_metadata = self.kv_connector.build_connector_meta(out)
        if self.ec_connector is not None:
            out.ec_connector_metadata = self.ec_connector.build_connector_meta(out)
        return out

    # ---- update -----------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        index_of = runner_output.req_id_to_index
        sampled = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        top_logprobs = runner_output.top_logprobs
        requests = self.requests
        running_status = RequestStatus.RUNNING
        num_stopped = 0
        if self.remote_kv is not None:
            self.remote_kv.publish_loaded_blocks(scheduler_output)
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for rid in scheduler_output.num_scheduled_tokens:
            request = requests.get(rid)
            if request is None or request.status != running_status:
                continue  # finished or preempted since it was scheduled
            if request.mm_features:
                free_consumed_encoder_inputs(request, self.encoder_cache_manager)
            add_prompt_logprobs(request, runner_output.prompt_logprobs.get(rid))
            i = index_of.get(rid)
            if i is None or not sampled[i]:
                continue  # partial prefill: no token
            if not request.output_token_ids:
                self.num_prompt_tokens += request.num_prompt_tokens
            drafts = spec_tokens.get(rid)
            if drafts:
                self.speculation.verified(request, len(drafts), len(sampled[i]))
            output = append_tokens(
                request,
                sampled[i],
                logprobs[i] if logprobs else None,
                top_logprobs[i] if top_logprobs else None,
                rid in runner_output.grammar_done_req_ids,
                self.max_model_len,
            )
            self.num_generation_tokens += len(output.new_token_ids)
            if output.finished:
                num_stopped += 1
                output.kv_transfer_params = self._finish(request)
            elif drafts:
                self.speculation.give_back_slots(request)
            outputs.append(output)
        if num_stopped:
            self.running[:] = [r for r in self.running if r.status == running_status]
        if runner_output.kv_connector_output is not None and self.remote_kv is not None:
            outputs.extend(self._update_from_kv_output(runner_output.kv_connector_output))
        return outputs

    def _update_from_kv_output(self, kv_output: KVConnectorOutput) -> list[EngineCoreOutput]:
        """Free what the connector no longer needs; end the requests whose load failed."""
        events = self.remote_kv.update(kv_output, self.requests)
        for request in events.to_free:
            self._free_request(request)
        self.skipped_waiting.remove_requests(events.failed)
        return [load_failed_output(r, self._finish(r)) for r in events.failed]

    def _finish(self, request: Request) -> KVTransferParams | None:
        """A request just reached a finished status (already out of every queue). Frees its
        blocks unless the KV connector delays that; returns its kv_transfer_params."""
        self.finished_req_ids.add(request.request_id)
        delay_free, params = False, None
        if self.remote_kv is not None:
            delay_free, params = self.remote_kv.request_finished(request)
        if not delay_free:
            self._free_request(request)
        return params

    def _free_request(self, request: Request) -> None:
        rid = request.request_id
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        del self.requests[rid]
        if self.remote_kv is not None:
            self.remote_kv.forget(rid)
        if self.speculation is not None:
            self.speculation.take_num_trimmed_blocks(rid)

    # ---- aborts and external stops ----------------------------------------------------
    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finish requests in any state (abort, stop string). Unknown ids are ignored."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        to_finish = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.is_finished():
                if self.remote_kv is not None and self.remote_kv.is_sending(rid):
                    self._free_request(request)  # finished on P, KV not yet read: free now
                continue  # aborted while loading: blocks wait for the load to land
            to_finish.append(request)
        if not to_finish:
            return
        gone = {id(r) for r in to_finish}
        self.running[:] = [r for r in self.running if id(r) not in gone]
        self.waiting.remove_requests(to_finish)
        self.skipped_waiting.remove_requests(to_finish)
        for request in to_finish:
            was_loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            request.status = finished_status
            if was_loading:
                self.remote_kv.abort_load(request.request_id)
                self.finished_req_ids.add(request.request_id)
            else:
                self._finish(request)
