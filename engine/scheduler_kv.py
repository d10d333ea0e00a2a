"""The scheduler's side of the KV connector: parking a request while its remote KV loads,
and the connector's events (sent, landed, failed) that end the wait. A part of `Scheduler`
(engine/scheduler.py), kept apart so that each file holds one concern."""

from __future__ import annotations

from pdcluster.engine.outputs import EngineCoreOutput, KVConnectorOutput, SchedulerOutput
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.scheduler_step import SKIP, STOP


class RemoteKV:
    """Mixed into Scheduler: uses its queues, block manager and connector."""

    def _update_from_kv_output(self, kv_output: KVConnectorOutput) -> list[EngineCoreOutput]:
        outputs = []
        for rid in kv_output.finished_sending:
            if rid in self._pending_sends:
                self._free_request(self.requests[rid])
        for rid in kv_output.failed_recving:
            output = self._on_load_failed(rid)
            if output is not None:
                outputs.append(output)
        for rid in kv_output.finished_recving:
            self._on_load_done(rid)
        return outputs

    def _on_load_done(self, rid: str) -> None:
        """Remote KV landed: the request resumes as WAITING with the loaded tokens computed,
        except the last prompt token when all were loaded (its logits are needed)."""
        request = self.requests.get(rid)
        if rid in self._aborted_recving:
            self._free_request(request)
            return
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return
        num_loaded = self._remote_loads.pop(rid)
        request.num_computed_tokens = min(num_loaded, request.num_tokens - 1)
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.WAITING
        self._no_remote_kv.add(rid)

    def _on_load_failed(self, rid: str) -> EngineCoreOutput | None:
        request = self.requests.get(rid)
        if rid in self._aborted_recving:
            self._free_request(request)
            return None
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return None
        self._remote_loads.pop(rid, None)
        self._no_remote_kv.add(rid)
        policy = self.scheduler_config.kv_load_failure_policy
        if policy == "recompute" or self.kv_connector.load_failure_recomputes(request):
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING  # stays in skipped_waiting, prefills here
            return None
        self.skipped_waiting.remove_requests((request,))
        request.status = RequestStatus.FINISHED_ERROR
        request.error = (
            f"request {rid!r}: loading its KV cache from the prefill instance failed "
            "(kv_load_failure_policy='fail')"
        )
        params = self._finish(request)
        return EngineCoreOutput(
            rid, [], finish_reason="error", error=request.error, kv_transfer_params=params,
            unavailable=True,  # the KV's producer is gone or late: elsewhere it may succeed
        )  # fmt: skip

    def _may_load_remote_kv(self, request: Request, has_blocks: bool) -> bool:
        return (
            self.kv_connector is not None
            and not has_blocks
            and request.num_preemptions == 0
            and request.request_id not in self._no_remote_kv
        )

    def _start_remote_load(
        self, request: Request, computed_blocks: list, num_computed: int, num_external: int
    ) -> int:
        """Allocate blocks for the whole prompt (the remote tokens and the ones computed
        here after they land, so two landed loads can never wait on each other's blocks) and
        park the request until the remote tokens land."""
        kv = self.kv_cache_manager
        num_local = request.num_tokens - num_computed - num_external
        new_blocks = kv.allocate_slots(
            request, num_local, num_computed, computed_blocks, num_external
        )
        if new_blocks is None:
            return STOP
        block_ids = kv.get_block_ids(request.request_id)
        self.kv_connector.update_state_after_alloc(request, block_ids, num_external)
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._remote_loads[request.request_id] = num_computed + num_external
        return SKIP

    def _publish_loaded_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """Publish the blocks of requests admitted with a synchronous remote load, which
        the step that just ran filled (the loaded tokens and the ones computed after them)."""
        ran = scheduler_output.num_scheduled_tokens
        for rid in self._publish_after_step:
            request = self.requests.get(rid)
            if rid in ran and request is not None and request.status == RequestStatus.RUNNING:
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        self._publish_after_step = []
