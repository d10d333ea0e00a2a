"""Shared helpers for scheduler tests: build a scheduler and requests, fake the runner with
hand-built RunnerOutputs, fake connectors with controllable behaviour, check idleness."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdcluster.connectors.base import ECConnectorBase, KVConnectorBase, KVTransferParams
from pdcluster.engine.config import CacheConfig, SchedulerConfig
from pdcluster.engine.outputs import (
    EngineCoreOutput,
    KVConnectorOutput,
    RunnerOutput,
    SchedulerOutput,
)
from pdcluster.engine.request import MultiModalFeature, Request
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.scheduler import Scheduler

EOS = 2
DEFAULT_TOKEN = 7  # what the fake runner samples unless told otherwise


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    encoder_compute_budget: int = 64,
    encoder_cache_size: int = 128,
    kv_load_failure_policy: str = "recompute",
    scheduling_policy: str = "fcfs",
    kv_connector: KVConnectorBase | None = None,
    ec_connector: ECConnectorBase | None = None,
) -> Scheduler:
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        encoder_compute_budget=encoder_compute_budget,
        encoder_cache_size=encoder_cache_size,
        kv_load_failure_policy=kv_load_failure_policy,
        scheduling_policy=scheduling_policy,
    )
    cache_config = CacheConfig(block_size=block_size, num_blocks=num_blocks)
    return Scheduler(scheduler_config, cache_config, kv_connector, ec_connector)


def make_requests(
    num_requests: int,
    num_tokens: int = 10,
    *,
    max_tokens: int | None = 4,
    id_prefix: str = "req",
    start: int = 0,
    prompt_token_ids: list[int] | None = None,
    mm_features: list[MultiModalFeature] | None = None,
    eos_token_id: int | None = EOS,
    kv_transfer_params: KVTransferParams | None = None,
    cache_salt: str | None = None,
    priority: int = 0,
    **sampling_kwargs: Any,
) -> list[Request]:
    """Requests with distinct prompts (token ids 100 + 1000*i + position) unless
    prompt_token_ids is given; no prompt contains EOS or DEFAULT_TOKEN."""
    requests = []
    for i in range(start, start + num_requests):
        prompt = prompt_token_ids or [100 + 1000 * i + j for j in range(num_tokens)]
        params = SamplingParams(max_tokens=max_tokens, **sampling_kwargs)
        requests.append(
            Request(
                f"{id_prefix}{i}",
                prompt,
                params,
                eos_token_ids=() if eos_token_id is None else (eos_token_id,),
                mm_features=[MultiModalFeature(f.mm_hash, f.offset, f.length) for f in mm_features]
                if mm_features
                else None,
                kv_transfer_params=kv_transfer_params,
                cache_salt=cache_salt,
                priority=priority,
            )
        )
    return requests


def image(mm_hash: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature(mm_hash, offset, length)


TokenChoice = int | dict[str, int] | Callable[[Request], int]


def make_runner_output(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    token_id: TokenChoice = DEFAULT_TOKEN,
    kv_connector_output: KVConnectorOutput | None = None,
) -> RunnerOutput:
    """What a runner returns: one sampled token for each request whose scheduled tokens
    reach its end (the scheduler already advanced num_computed_tokens), [] otherwise."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        request = scheduler.requests.get(rid)
        if request is None or request.num_computed_tokens < request.num_tokens:
            sampled.append([])
        elif isinstance(token_id, int):
            sampled.append([token_id])
        elif isinstance(token_id, dict):
            sampled.append([token_id.get(rid, DEFAULT_TOKEN)])
        else:
            sampled.append([token_id(request)])
    return RunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_connector_output,
    )


def step(
    scheduler: Scheduler,
    token_id: TokenChoice = DEFAULT_TOKEN,
    kv_connector_output: KVConnectorOutput | None = None,
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One schedule() + fake model run + update_from_output()."""
    so = scheduler.schedule()
    ro = make_runner_output(scheduler, so, token_id, kv_connector_output)
    return so, scheduler.update_from_output(so, ro)


def run_until_done(
    scheduler: Scheduler, token_id: TokenChoice = DEFAULT_TOKEN, max_steps: int = 1000
) -> dict[str, list[EngineCoreOutput]]:
    """Step until no request is left; outputs grouped by request id."""
    outputs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return outputs
        _, outs = step(scheduler, token_id)
        for out in outs:
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"requests left after {max_steps} steps: {scheduler.stats()}")


def output_tokens(outputs: list[EngineCoreOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def assert_idle(scheduler: Scheduler) -> None:
    """Every block free, no request, no queue entry, no referenced encoder output."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks, scheduler.stats()
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert not kv.req_to_blocks
    assert not scheduler.requests, list(scheduler.requests)
    assert not scheduler.waiting and not scheduler.skipped_waiting and not scheduler.running
    assert not scheduler.has_unfinished_requests()
    assert scheduler.encoder_cache_manager.num_referenced_entries() == 0
    stats = scheduler.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert stats["num_pending_sends"] == 0 and stats["num_pending_recvs"] == 0


class FakeKVConnector(KVConnectorBase):
    """Scheduler side only. `matched[request_id]`: total tokens available remotely (None:
    not known yet); requests not named match nothing. Records every call."""

    def __init__(
        self,
        matched: dict[str, int | None] | None = None,
        load_async: bool = True,
        delay_free: bool = False,
    ) -> None:
        self.matched = dict(matched or {})
        self.load_async = load_async
        self.delay_free = delay_free
        self.num_queries = 0
        self.allocs: list[tuple[str, list[int], int]] = []
        self.finished: list[tuple[str, list[int]]] = []
        self.num_meta_builds = 0

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.num_queries += 1
        if request.request_id not in self.matched:
            return 0, False
        total = self.matched[request.request_id]
        if total is None:
            return None, False
        return max(0, total - num_computed_tokens), self.load_async

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.allocs.append((request.request_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        self.num_meta_builds += 1
        return {"step": self.num_meta_builds}

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        self.finished.append((request.request_id, list(block_ids)))
        if not self.delay_free or request.get_finished_reason() == "abort":
            return False, None
        return True, KVTransferParams(
            remote_request_id=request.request_id, num_tokens=request.num_tokens
        )

    def start_load_kv(self, metadata: Any) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), set()


class FakeECConnector(ECConnectorBase):
    """Encoder outputs in `available` can be loaded; a request is deferred while any of its
    features still needed is not available."""

    def __init__(self, available: set[str] | None = None) -> None:
        self.available = set(available or ())
        self.loads: list[tuple[str, int]] = []
        self.num_meta_builds = 0

    def has_cache_item(self, mm_hash: str) -> bool:
        return mm_hash in self.available

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        return all(
            f.mm_hash in self.available for f in request.mm_features if f.end > num_computed_tokens
        )

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self.loads.append((request.request_id, index))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        self.num_meta_builds += 1
        return list(self.loads)

    def start_load_caches(self, metadata: Any, encoder_cache: dict) -> None:
        pass
