"""Scheduler behaviour with hand-built runner outputs and fake connectors (no model, no Ray).
Every test ends with the scheduler idle: all blocks free, no request, no queue entry."""

from __future__ import annotations

import pytest

from pdcluster.connectors.base import KVTransferParams
from pdcluster.engine.outputs import KVConnectorOutput, RunnerOutput
from pdcluster.engine.request import RequestStatus
from tests.scheduler_utils import (
    DEFAULT_TOKEN,
    EOS,
    FakeECConnector,
    FakeKVConnector,
    assert_idle,
    image,
    make_requests,
    make_scheduler,
    output_tokens,
    run_until_done,
    step,
)

ABORTED = RequestStatus.FINISHED_ABORTED


def add_all(scheduler, requests):
    for request in requests:
        scheduler.add_request(request)
    return requests


# ---- budget, chunking, limits -----------------------------------------------------------
def test_fcfs_within_token_budget_and_last_prompt_is_chunked():
    s = make_scheduler(max_num_batched_tokens=25)
    add_all(s, make_requests(3, 10))
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"req0": 10, "req1": 10, "req2": 5}
    assert so.total_num_scheduled_tokens == 25
    assert [r.req_id for r in so.scheduled_new_reqs] == ["req0", "req1", "req2"]
    assert [o.request_id for o in outs] == ["req0", "req1"]  # req2 prefill is partial
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"req0": 1, "req1": 1, "req2": 5}
    assert so.scheduled_cached_reqs.req_ids == ["req0", "req1", "req2"]
    outputs = run_until_done(s)
    assert all(len(output_tokens(outputs[r])) >= 2 for r in ("req0", "req1", "req2"))
    assert_idle(s)


def test_chunked_prefill_produces_one_token_at_the_end():
    s = make_scheduler(max_num_batched_tokens=8)
    (request,) = add_all(s, make_requests(1, 30, max_tokens=3))
    chunks = []
    for _ in range(4):
        so, outs = step(s)
        chunks.append(so.num_scheduled_tokens["req0"])
        assert bool(outs) == (len(chunks) == 4)
    assert chunks == [8, 8, 8, 6]
    assert request.num_output_tokens == 1
    outputs = run_until_done(s)
    assert output_tokens(outputs["req0"]) == [DEFAULT_TOKEN] * 2
    assert outputs["req0"][-1].finish_reason == "length"
    assert_idle(s)


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_num_seqs=2)
    add_all(s, make_requests(5, 6))
    so, _ = step(s)
    assert set(so.num_scheduled_tokens) == {"req0", "req1"}
    assert len(s.running) == 2 and len(s.waiting) == 3
    outputs = run_until_done(s)
    assert len(outputs) == 5 and all(o[-1].finished for o in outputs.values())
    assert_idle(s)


def test_preemption_by_recompute_when_blocks_run_out_then_all_complete():
    # 3 x 8-token prompts take 6 of 8 blocks; decoding to 20 tokens needs 15.
    s = make_scheduler(num_blocks=8, block_size=4, enable_prefix_caching=False)
    add_all(s, make_requests(3, 8, max_tokens=12))
    preempted, resumed = set(), set()
    outputs = {}
    for _ in range(200):
        if not s.has_requests():
            break
        so, outs = step(s)
        preempted |= so.preempted_req_ids
        for rid in so.preempted_req_ids:
            assert s.requests[rid].status == RequestStatus.PREEMPTED
            assert s.requests[rid].num_computed_tokens == 0
            assert s.waiting[0].status == RequestStatus.PREEMPTED
        cached = so.scheduled_cached_reqs
        for rid, was_preempted, blocks in zip(
            cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids, strict=True
        ):
            if was_preempted:
                resumed.add(rid)
                assert len(blocks) * 4 >= so.num_scheduled_tokens[rid]
        for out in outs:
            outputs.setdefault(out.request_id, []).append(out)
    assert "req2" in preempted and preempted <= resumed
    for rid in ("req0", "req1", "req2"):
        assert output_tokens(outputs[rid]) == [DEFAULT_TOKEN] * 12
    assert_idle(s)


def test_preempted_request_recomputes_prompt_and_outputs():
    s = make_scheduler(num_blocks=5, block_size=4, enable_prefix_caching=False)
    a, b = add_all(s, make_requests(2, 8, max_tokens=8))
    while not b.num_preemptions:
        step(s)
    num_output_before = b.num_output_tokens
    assert num_output_before > 0
    while b.status != RequestStatus.RUNNING:
        so, _ = step(s)
    assert so.num_scheduled_tokens["req1"] == 8 + num_output_before
    run_until_done(s)
    assert b.num_output_tokens == 8
    assert_idle(s)


# ---- prefix caching ---------------------------------------------------------------------
@pytest.mark.parametrize("enable", [True, False])
def test_prefix_cache_reuse_across_requests(enable):
    s = make_scheduler(enable_prefix_caching=enable)
    (a,) = add_all(s, make_requests(1, 22, max_tokens=2))
    run_until_done(s)
    (b,) = add_all(s, make_requests(1, prompt_token_ids=a.prompt_token_ids, id_prefix="b"))
    so, _ = step(s)
    expected = 20 if enable else 0  # full blocks only, never the last token
    assert so.scheduled_new_reqs[0].num_computed_tokens == expected
    assert so.num_scheduled_tokens["b0"] == 22 - expected
    outputs = run_until_done(s)
    assert outputs["b0"][0].num_cached_tokens == expected
    assert_idle(s)


def test_prefix_cache_includes_generated_tokens():
    s = make_scheduler()
    (a,) = add_all(s, make_requests(1, 8, max_tokens=9))
    run_until_done(s)
    prompt = a.prompt_token_ids + a.output_token_ids[:-1]  # 16 tokens whose KV was computed
    add_all(s, make_requests(1, prompt_token_ids=prompt + [1], id_prefix="b"))
    so, _ = step(s)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    run_until_done(s)
    assert_idle(s)


def test_burst_sharing_a_prefix_hits_blocks_scheduled_in_the_same_step():
    s = make_scheduler(max_num_batched_tokens=64)
    shared = [500 + j for j in range(20)]  # 5 full blocks
    requests = [
        make_requests(1, prompt_token_ids=[*shared, 900 + i, 950 + i], start=i)[0] for i in range(8)
    ]
    add_all(s, requests)
    so, _ = step(s)
    # All eight fit in the first step: the first computes 22 tokens, the rest only their
    # own 2, reading the 5 shared blocks the first one writes in this very step.
    assert [n.num_computed_tokens for n in so.scheduled_new_reqs] == [0] + [20] * 7
    assert so.num_scheduled_tokens == {"req0": 22, **{f"req{i}": 2 for i in range(1, 8)}}
    first_blocks = s.kv_cache_manager.get_block_ids("req0")[:5]
    for new_req in so.scheduled_new_reqs[1:]:
        assert new_req.block_ids[:5] == first_blocks
    outputs = run_until_done(s)
    assert [outputs[r.request_id][0].num_cached_tokens for r in requests] == [0] + [20] * 7
    assert_idle(s)


def test_abort_of_a_request_whose_blocks_others_hit_in_its_step_keeps_them_for_those():
    s = make_scheduler()
    shared = [500 + j for j in range(12)]
    a, b = add_all(
        s, [make_requests(1, prompt_token_ids=[*shared, 900 + i], start=i)[0] for i in range(2)]
    )
    so, first = step(s)
    assert so.scheduled_new_reqs[1].num_computed_tokens == 12
    s.finish_requests("req0", ABORTED)
    shared_blocks = s.kv_cache_manager.req_to_blocks["req1"][:3]
    assert [blk.ref_cnt for blk in shared_blocks] == [1, 1, 1]
    outputs = run_until_done(s)
    assert output_tokens([first[1], *outputs["req1"]]) == [DEFAULT_TOKEN] * 4
    assert_idle(s)


def test_running_chunk_publishes_its_blocks_to_requests_admitted_after_it():
    s = make_scheduler(max_num_batched_tokens=24)
    (a,) = add_all(s, make_requests(1, 40, max_tokens=1))
    (b,) = add_all(s, make_requests(1, prompt_token_ids=a.prompt_token_ids, id_prefix="b"))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"req0": 24}
    so, _ = step(s)
    # req0's second chunk fills blocks 6..9 this step; b0 hits 9 of them (not the last
    # token's block), 3 of which are written by the same forward pass.
    assert so.num_scheduled_tokens == {"req0": 16, "b0": 4}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 36
    run_until_done(s)
    assert_idle(s)


@pytest.mark.parametrize("load_async", [True, False])
def test_remote_loaded_blocks_are_not_shared_before_the_load_landed(load_async):
    kv = FakeKVConnector({"req0": 8}, load_async=load_async)
    s = make_scheduler(kv_connector=kv)
    (a,) = add_all(s, make_requests(1, 13, max_tokens=1))
    (b,) = add_all(s, make_requests(1, prompt_token_ids=a.prompt_token_ids, id_prefix="b"))
    so, _ = step(s)
    assert {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}["b0"] == 0
    if load_async:
        step(s, kv_connector_output=KVConnectorOutput(finished_recving={"req0"}))
    (c,) = add_all(s, make_requests(1, prompt_token_ids=a.prompt_token_ids, id_prefix="c"))
    so, _ = step(s)
    assert {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}["c0"] == 12
    run_until_done(s)
    assert_idle(s)


def test_image_hash_prevents_false_prefix_hit():
    s = make_scheduler()
    prompt = [11, 12, 13, 14] + [99] * 8 + [15, 16, 17, 18, 19]
    add_all(s, make_requests(1, prompt_token_ids=prompt, mm_features=[image("cat", 4, 8)]))
    run_until_done(s)
    add_all(s, make_requests(1, prompt_token_ids=prompt, mm_features=[image("dog", 4, 8)], start=1))
    add_all(s, make_requests(1, prompt_token_ids=prompt, mm_features=[image("cat", 4, 8)], start=2))
    so, _ = step(s)
    hits = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    assert hits == {"req1": 4, "req2": 16}  # dog: only the text block before the image
    assert "req1" in so.scheduled_encoder_inputs and "req2" not in so.scheduled_encoder_inputs
    run_until_done(s)
    assert_idle(s)


# ---- encoder cache ----------------------------------------------------------------------
def test_encoder_budget_cuts_tokens_before_the_image_and_cache_is_shared():
    s = make_scheduler(encoder_compute_budget=8, encoder_cache_size=16)
    img = [image("img", 2, 8)]
    add_all(s, make_requests(2, 14, mm_features=img))
    add_all(s, make_requests(1, 14, mm_features=[image("other", 2, 8)], start=2))
    so, _ = step(s)
    assert so.scheduled_encoder_inputs == {"req0": [0]}  # req1 reuses req0's encoder output
    assert so.num_scheduled_tokens == {"req0": 14, "req1": 14, "req2": 2}  # stops before image
    so, _ = step(s)
    assert so.scheduled_encoder_inputs == {"req2": [0]}
    assert so.num_scheduled_tokens["req2"] == 12
    run_until_done(s)
    assert s.encoder_cache_manager.num_referenced_entries() == 0
    add_all(s, make_requests(1, 14, mm_features=img, start=3))
    so, _ = step(s)
    assert so.scheduled_encoder_inputs == {}  # still cached though unreferenced: reused
    run_until_done(s)
    assert_idle(s)


def test_encoder_cache_full_defers_image_until_space_and_reports_evictions():
    s = make_scheduler(encoder_compute_budget=8, encoder_cache_size=8)
    add_all(s, make_requests(1, 12, mm_features=[image("a", 0, 8)], max_tokens=3))
    add_all(s, make_requests(1, 12, mm_features=[image("b", 0, 8)], start=1, max_tokens=3))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"req0": 12}  # req1 cannot start: cache is full
    freed = []
    while s.has_requests():
        so, _ = step(s)
        freed += so.free_encoder_mm_hashes
        if "req1" in so.scheduled_encoder_inputs:
            assert freed == ["a"]
    assert freed == ["a"]
    assert_idle(s)


def test_image_placeholder_run_split_across_chunks_keeps_encoder_output():
    s = make_scheduler(max_num_batched_tokens=6, encoder_compute_budget=16)
    (r,) = add_all(s, make_requests(1, 20, mm_features=[image("img", 3, 12)]))
    so, _ = step(s)
    assert so.scheduled_encoder_inputs == {"req0": [0]} and so.num_scheduled_tokens["req0"] == 6
    so, _ = step(s)
    assert so.scheduled_encoder_inputs == {}
    assert s.encoder_cache_manager.get_cached_input_ids(r) == [0]
    step(s)  # computed 18 > image end 15: released
    assert s.encoder_cache_manager.num_referenced_entries() == 0
    run_until_done(s)
    assert_idle(s)


# ---- EC connector (encoder disaggregation) ----------------------------------------------
def test_ec_deferred_request_holds_nothing_while_text_request_runs():
    ec = FakeECConnector()
    s = make_scheduler(ec_connector=ec)
    (mm,) = add_all(s, make_requests(1, 12, mm_features=[image("img", 2, 8)], id_prefix="mm"))
    (text,) = add_all(s, make_requests(1, 6, id_prefix="text"))
    so, _ = step(s)
    assert set(so.num_scheduled_tokens) == {"text0"}
    assert list(s.skipped_waiting) == [mm] and mm.status == RequestStatus.WAITING
    assert "mm0" not in s.kv_cache_manager.req_to_blocks
    assert not s.encoder_cache_manager.cached
    while "text0" in s.requests:
        step(s)
    assert s.stats()["num_deferred"] == 1 and not s.encoder_cache_manager.cached
    ec.available.add("img")
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"mm0": 12}
    assert so.scheduled_encoder_inputs == {}  # loaded, not encoded
    assert ec.loads == [("mm0", 0)] and so.ec_connector_metadata == [("mm0", 0)]
    assert s.encoder_cache_manager.is_cached("img")  # held for the runner, now freeable
    outputs = run_until_done(s)
    assert outputs["mm0"][-1].finished
    assert_idle(s)


def test_ec_available_item_uses_no_compute_budget():
    ec = FakeECConnector({"big"})
    s = make_scheduler(ec_connector=ec, encoder_compute_budget=4, encoder_cache_size=32)
    add_all(s, make_requests(1, 20, mm_features=[image("big", 0, 16)]))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"req0": 20} and so.scheduled_encoder_inputs == {}
    run_until_done(s)
    assert_idle(s)


def test_ec_ensure_cache_available_only_for_features_not_yet_computed():
    ec = FakeECConnector({"img"})
    s = make_scheduler(ec_connector=ec)
    prompt = list(range(100, 112))
    add_all(s, make_requests(1, prompt_token_ids=prompt, mm_features=[image("img", 0, 8)]))
    run_until_done(s)
    ec.available.clear()  # the image is fully inside the cached prefix: no deferral
    add_all(s, make_requests(1, prompt_token_ids=prompt, mm_features=[image("img", 0, 8)], start=1))
    so, _ = step(s)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    run_until_done(s)
    assert_idle(s)


# ---- KV connector: producer -------------------------------------------------------------
def test_producer_delays_free_until_finished_sending():
    kv = FakeKVConnector(delay_free=True)
    s = make_scheduler(kv_connector=kv)
    (r,) = add_all(s, make_requests(1, 10, max_tokens=1))
    so, outs = step(s)
    assert so.kv_connector_metadata == {"step": 1}
    (out,) = outs
    assert out.finish_reason == "length"
    assert out.kv_transfer_params == KVTransferParams(remote_request_id="req0", num_tokens=11)
    assert kv.finished == [("req0", s.kv_cache_manager.get_block_ids("req0"))]
    assert s.kv_cache_manager.get_num_free_blocks() == 64 - 3
    assert s.has_requests() and s.has_finished_requests() and not s.has_unfinished_requests()
    assert s.stats()["num_pending_sends"] == 1
    so, _ = step(s)
    assert so.finished_req_ids == {"req0"} and so.total_num_scheduled_tokens == 0
    assert s.has_requests()  # still holding blocks
    step(s, kv_connector_output=KVConnectorOutput(finished_sending={"req0"}))
    assert not s.has_requests()
    assert_idle(s)


# ---- KV connector: consumer -------------------------------------------------------------
def test_consumer_async_load_waits_holding_blocks_then_decodes():
    kv = FakeKVConnector({"req0": 12})
    s = make_scheduler(kv_connector=kv)
    (r,) = add_all(s, make_requests(1, 13, max_tokens=3))
    so, _ = step(s)
    assert so.total_num_scheduled_tokens == 0
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and list(s.skipped_waiting) == [r]
    assert kv.allocs == [("req0", s.kv_cache_manager.get_block_ids("req0"), 12)]
    assert s.kv_cache_manager.get_num_free_blocks() == 64 - 4  # the whole 13-token prompt
    assert s.stats()["num_pending_recvs"] == 1 and s.has_unfinished_requests()
    step(s)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(s, kv_connector_output=KVConnectorOutput(finished_recving={"req0"}))
    assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 12
    so, outs = step(s)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12
    assert so.num_scheduled_tokens == {"req0": 1} and outs[0].new_token_ids == [DEFAULT_TOKEN]
    outputs = run_until_done(s)
    assert r.num_output_tokens == 3 and outputs["req0"][-1].finish_reason == "length"
    assert kv.num_queries == 1
    assert_idle(s)


def land_early(scheduler, finished_recving: set[str]):
    """The engine core's pass ahead of schedule(): park new remote loads; the loads named in
    finished_recving land right away (their data was local)."""
    early = scheduler.schedule_remote_loads()
    if early is not None:
        kv_output = KVConnectorOutput(finished_recving=finished_recving)
        scheduler.update_from_output(early, RunnerOutput(kv_connector_output=kv_output))
    return early


def test_remote_load_parked_ahead_of_schedule_runs_in_the_same_step():
    kv = FakeKVConnector({"req0": 12, "req1": 12})
    s = make_scheduler(kv_connector=kv)
    r0, r1 = add_all(s, make_requests(2, 13, max_tokens=3))
    early = land_early(s, {"req0"})
    assert early.total_num_scheduled_tokens == 0 and not early.num_scheduled_tokens
    assert early.kv_connector_metadata == {"step": 1}
    assert [a[0] for a in kv.allocs] == ["req0", "req1"]
    assert r0.status == RequestStatus.WAITING and r0.num_computed_tokens == 12
    assert r1.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not s.waiting
    so, outs = step(s)  # the same step: req0 decodes, req1 still loads
    assert so.num_scheduled_tokens == {"req0": 1} and outs[0].new_token_ids == [DEFAULT_TOKEN]
    assert land_early(s, set()) is None  # nothing new to park
    step(s, kv_connector_output=KVConnectorOutput(finished_recving={"req1"}))
    run_until_done(s)
    assert r0.num_output_tokens == 3 and r1.num_output_tokens == 3
    assert kv.num_queries == 2
    assert_idle(s)


def test_remote_load_pass_keeps_fcfs_block_order():
    kv = FakeKVConnector({"req0": 12, "req2": 12})
    s = make_scheduler(kv_connector=kv)
    r0, r1, r2 = add_all(s, make_requests(3, 13, max_tokens=2))
    land_early(s, set())
    assert r0.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert list(s.waiting) == [r1, r2]  # stops at the local prefill: req2 does not jump it
    so, _ = step(s)  # schedule() parks req2 after req1 got its blocks
    assert so.num_scheduled_tokens == {"req1": 13}
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(s, kv_connector_output=KVConnectorOutput(finished_recving={"req0", "req2"}))
    run_until_done(s)
    assert_idle(s)


def test_remote_load_pass_leaves_a_block_per_running_request():
    kv = FakeKVConnector({"req1": 12})
    s = make_scheduler(kv_connector=kv, num_blocks=8, block_size=4)
    (local,) = add_all(s, make_requests(1, 14, max_tokens=6))
    step(s)  # 4 of 8 blocks; the 13-token remote prompt needs the other 4
    (remote,) = add_all(s, make_requests(1, 13, max_tokens=2, start=1))
    assert land_early(s, set()) is None and list(s.waiting) == [remote]
    step(s)  # schedule() parks it once the running request has its blocks for this step
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(s, kv_connector_output=KVConnectorOutput(finished_recving={"req1"}))
    run_until_done(s)
    assert local.num_output_tokens == 6 and remote.num_output_tokens == 2
    assert_idle(s)


def test_remote_load_pass_waits_behind_a_deferred_request_without_blocks():
    kv = FakeKVConnector({"req0": None, "req1": 12})
    s = make_scheduler(kv_connector=kv)
    (deferred,) = add_all(s, make_requests(1, 13))
    step(s)
    assert list(s.skipped_waiting) == [deferred]  # the connector does not know yet
    (remote,) = add_all(s, make_requests(1, 13, start=1))
    assert land_early(s, set()) is None and list(s.waiting) == [remote]
    kv.matched["req0"] = 0
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"req0": 13}
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(s, kv_connector_output=KVConnectorOutput(finished_recving={"req1"}))
    run_until_done(s)
    assert_idle(s)


def test_consumer_full_remote_prompt_recomputes_last_token_and_caches_loaded_blocks():
    kv = FakeKVConnector({"req0": 12})
    s = make_scheduler(kv_connector=kv)
    (r,) = add_all(s, make_requests(1, 12, max_tokens=1))
    step(s)
    step(s, kv_connector_output=KVConnectorOutput(finished_recving={"req0"}))
    assert r.num_computed_tokens == 11
    (b,) = add_all(s, make_requests(1, prompt_token_ids=r.prompt_token_ids, id_prefix="b"))
    so, _ = step(s)
    assert so.num_scheduled_tokens["req0"] == 1
    hits = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
    assert hits == {"req0": 11, "b0": 8}  # b0 hits the loaded full blocks
    run_until_done(s)
    assert_idle(s)


def test_consumer_unknown_match_waits_without_blocking_others():
    kv = FakeKVConnector({"req0": None})
    s = make_scheduler(kv_connector=kv)
    a, b = add_all(s, make_requests(2, 8))
    so, _ = step(s)
    assert set(so.num_scheduled_tokens) == {"req1"} and list(s.skipped_waiting) == [a]
    assert "req0" not in s.kv_cache_manager.req_to_blocks
    kv.matched["req0"] = 0
    run_until_done(s)
    assert_idle(s)


def test_consumer_sync_load_counts_external_tokens_as_computed():
    kv = FakeKVConnector({"req0": 8}, load_async=False)
    s = make_scheduler(kv_connector=kv)
    add_all(s, make_requests(1, 10))
    so, _ = step(s)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert so.num_scheduled_tokens == {"req0": 2}
    run_until_done(s)
    assert_idle(s)


def test_load_failure_recompute_prefills_locally():
    kv = FakeKVConnector({"req0": 12})
    s = make_scheduler(kv_connector=kv, kv_load_failure_policy="recompute")
    (r,) = add_all(s, make_requests(1, 13, max_tokens=2))
    step(s)
    _, outs = step(s, kv_connector_output=KVConnectorOutput(failed_recving={"req0"}))
    assert outs == [] and r.status == RequestStatus.WAITING and r.num_computed_tokens == 0
    assert s.kv_cache_manager.get_num_free_blocks() == 64
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"req0": 13}
    outputs = run_until_done(s)
    assert kv.num_queries == 1 and outputs["req0"][-1].finish_reason == "length"
    assert_idle(s)


def test_load_failure_fail_policy_reports_error():
    kv = FakeKVConnector({"req0": 12})
    s = make_scheduler(kv_connector=kv, kv_load_failure_policy="fail")
    add_all(s, make_requests(1, 13))
    step(s)
    _, outs = step(s, kv_connector_output=KVConnectorOutput(failed_recving={"req0"}))
    (out,) = outs
    assert out.finish_reason == "error" and "KV cache" in out.error and "req0" in out.error
    so, _ = step(s)
    assert so.finished_req_ids == {"req0"}
    assert_idle(s)


# ---- aborts in every state --------------------------------------------------------------
def test_abort_waiting():
    s = make_scheduler()
    add_all(s, make_requests(2, 8))
    s.finish_requests("req0", ABORTED)
    assert s.finished_req_ids == {"req0"} and [r.request_id for r in s.waiting] == ["req1"]
    run_until_done(s)
    assert_idle(s)


def test_abort_deferred_in_skipped_waiting():
    s = make_scheduler(ec_connector=FakeECConnector())
    add_all(s, make_requests(1, 12, mm_features=[image("img", 0, 8)]))
    step(s)
    assert len(s.skipped_waiting) == 1
    s.finish_requests(["req0"], ABORTED)
    assert_idle(s)


def test_abort_running_mid_prefill():
    s = make_scheduler(max_num_batched_tokens=8)
    add_all(s, make_requests(1, 20, mm_features=[image("img", 4, 8)]))
    step(s)
    assert s.encoder_cache_manager.num_referenced_entries() == 1
    s.finish_requests("req0", ABORTED)
    so = s.schedule()
    assert so.finished_req_ids == {"req0"} and so.total_num_scheduled_tokens == 0
    assert_idle(s)


def test_abort_running_decoding():
    s = make_scheduler()
    add_all(s, make_requests(2, 8, max_tokens=10))
    step(s)
    step(s)
    s.finish_requests(["req1", "nope"], ABORTED)
    outputs = run_until_done(s)
    assert "req1" not in outputs and len(output_tokens(outputs["req0"])) == 8
    assert_idle(s)


def test_abort_preempted():
    s = make_scheduler(num_blocks=5, block_size=4, enable_prefix_caching=False)
    a, b = add_all(s, make_requests(2, 8, max_tokens=8))
    while b.status != RequestStatus.PREEMPTED:
        step(s)
    s.finish_requests("req1", ABORTED)
    run_until_done(s)
    assert a.num_output_tokens == 8
    assert_idle(s)


@pytest.mark.parametrize("landing", ["finished_recving", "failed_recving"])
def test_abort_waiting_for_remote_kvs_holds_blocks_until_load_lands(landing):
    kv = FakeKVConnector({"req0": 12})
    s = make_scheduler(kv_connector=kv)
    (r,) = add_all(s, make_requests(1, 13))
    step(s)
    s.finish_requests("req0", ABORTED)
    assert r.status == ABORTED and not s.skipped_waiting
    assert s.kv_cache_manager.get_num_free_blocks() == 64 - 4  # the read may still land
    assert s.has_requests() and not s.has_unfinished_requests()
    so, _ = step(s)
    assert so.finished_req_ids == {"req0"}
    s.finish_requests("req0", ABORTED)  # again: still a no-op
    _, outs = step(s, kv_connector_output=KVConnectorOutput(**{landing: {"req0"}}))
    assert outs == []
    assert_idle(s)


def test_abort_finished_delayed_free_on_producer_frees_once():
    kv = FakeKVConnector(delay_free=True)
    s = make_scheduler(kv_connector=kv)
    add_all(s, make_requests(1, 10, max_tokens=1))
    step(s)
    assert s.stats()["num_pending_sends"] == 1
    s.finish_requests("req0", ABORTED)
    assert_idle(s)
    step(s, kv_connector_output=KVConnectorOutput(finished_sending={"req0"}))  # late ack
    assert_idle(s)


def test_abort_unknown_id_is_noop():
    s = make_scheduler()
    s.finish_requests(["ghost"], ABORTED)
    assert not s.finished_req_ids
    assert_idle(s)


def test_external_stop_string_finish():
    s = make_scheduler()
    add_all(s, make_requests(1, 8, max_tokens=10))
    step(s)
    s.finish_requests("req0", RequestStatus.FINISHED_STOPPED)
    assert s.has_finished_requests() and not s.has_unfinished_requests()
    assert_idle(s)


# ---- stop conditions --------------------------------------------------------------------
def eos_at(n: int):
    return lambda request: EOS if request.num_output_tokens + 1 == n else DEFAULT_TOKEN


@pytest.mark.parametrize(
    ("kwargs", "tokens", "num_out", "reason", "stop_reason"),
    [
        ({}, eos_at(3), 3, "stop", None),
        ({"ignore_eos": True}, eos_at(3), 8, "length", None),
        ({"min_tokens": 5}, eos_at(3), 8, "length", None),
        ({"min_tokens": 2}, eos_at(3), 3, "stop", None),
        ({"stop_token_ids": [DEFAULT_TOKEN]}, DEFAULT_TOKEN, 1, "stop", DEFAULT_TOKEN),
        ({}, DEFAULT_TOKEN, 8, "length", None),
    ],
)
def test_stop_conditions(kwargs, tokens, num_out, reason, stop_reason):
    s = make_scheduler()
    (r,) = add_all(s, make_requests(1, 6, max_tokens=8, **kwargs))
    outputs = run_until_done(s, token_id=tokens)
    assert r.num_output_tokens == num_out
    assert outputs["req0"][-1].finish_reason == reason
    assert outputs["req0"][-1].stop_reason == stop_reason
    assert sum(o.finished for o in outputs["req0"]) == 1
    assert_idle(s)


def test_max_model_len_caps_length():
    s = make_scheduler(max_model_len=12)
    (r,) = add_all(s, make_requests(1, 10, max_tokens=None))
    outputs = run_until_done(s)
    assert r.num_tokens == 12 and outputs["req0"][-1].finish_reason == "length"
    assert_idle(s)


def test_add_request_rejects_duplicate_id_and_overlong_prompt():
    s = make_scheduler(max_model_len=16)
    add_all(s, make_requests(1, 8))
    with pytest.raises(ValueError):
        s.add_request(make_requests(1, 8)[0])
    with pytest.raises(ValueError):
        s.add_request(make_requests(1, 17, start=5)[0])
    with pytest.raises(ValueError):  # an image the encoder cache can never hold
        s.add_request(make_requests(1, 8, mm_features=[image("x", 0, 500)], start=6)[0])
    run_until_done(s)
    assert_idle(s)
