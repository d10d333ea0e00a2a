"""RayKVConnector against a real local Ray: publish, load, ack, lease, cancel, failures."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import pytest
import torch

from pdcluster.connectors import faults
from pdcluster.connectors.base import KVHandle, KVTransferParams
from pdcluster.connectors.ray_kv import RayKVConnector
from pdcluster.connectors.ray_kv_layout import RayKVHandle, consecutive_runs, plan_segments
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.sampling_params import SamplingParams
from tests.cluster_utils import our_objects_in_store, wait_until

BLOCK_SIZE = 4
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 8


# ---- helpers ---------------------------------------------------------------------------------
def make_pool(num_blocks: int, seed: int | None = None, dtype=torch.float32) -> torch.Tensor:
    shape = (num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def make_request(
    rid: str, num_tokens: int, params: KVTransferParams | dict | None = None
) -> Request:
    return Request(rid, list(range(num_tokens)), SamplingParams(max_tokens=1), None, None, params)


def finished_prefill(rid: str, num_tokens: int, status=RequestStatus.FINISHED_LENGTH_CAPPED):
    request = make_request(rid, num_tokens, {"do_remote_decode": True})
    request.num_computed_tokens = num_tokens
    request.append_output_token(7)
    request.status = status
    return request


class AckLog:
    """ack_sender for tests: records acks and forwards them to known producers."""

    def __init__(self, producers: dict[str, RayKVConnector] | None = None) -> None:
        self.acks: list[tuple[str, str]] = []
        self.epochs: list[str] = []
        self.producers = producers or {}

    def __call__(self, remote_engine_id: str, remote_request_id: str, epoch: str) -> None:
        self.acks.append((remote_engine_id, remote_request_id))
        self.epochs.append(epoch)
        if remote_engine_id in self.producers:
            self.producers[remote_engine_id].ack(remote_request_id, epoch)


def make_producer(num_blocks: int = 16, seed: int = 0, **kwargs) -> RayKVConnector:
    producer = RayKVConnector("prefill-0", "producer", BLOCK_SIZE, **kwargs)
    producer.register_kv_caches(make_pool(num_blocks, seed))
    return producer


def make_consumer(ack_log: AckLog, num_blocks: int = 12, **kwargs) -> RayKVConnector:
    consumer = RayKVConnector("decode-0", "consumer", BLOCK_SIZE, ack_sender=ack_log, **kwargs)
    consumer.register_kv_caches(make_pool(num_blocks))
    return consumer


def load(
    consumer: RayKVConnector, request: Request, block_ids: list[int], num_computed: int = 0
) -> tuple[str, set[str], set[str]]:
    """Drive the consumer as the scheduler and engine core do until the load resolves.
    Returns ("landed" | "failed", every finished_recving, every failed load)."""
    num_external, load_async = consumer.get_num_new_matched_tokens(request, num_computed)
    assert load_async and num_external > 0
    consumer.update_state_after_alloc(request, block_ids, num_external)
    consumer.start_load_kv(consumer.build_connector_meta(None))
    recving, failed = set(), set()
    deadline = time.monotonic() + 20
    while request.request_id not in recving | failed and time.monotonic() < deadline:
        recving |= consumer.get_finished(set())[1]
        failed |= consumer.get_failed_loads()
        time.sleep(0.005)
    outcome = "landed" if request.request_id in recving else "failed"
    return outcome, recving, failed


def with_handle(params: KVTransferParams, **changes) -> KVTransferParams:
    return dataclasses.replace(params, handle=dataclasses.replace(params.handle, **changes))


def drain_sends(producer: RayKVConnector, rounds: int = 3) -> list[str]:
    """Every finished_sending report over a few get_finished calls, duplicates kept."""
    reported: list[str] = []
    for _ in range(rounds):
        reported.extend(producer.get_finished(set())[0])
    return reported


@pytest.fixture
def ray(ray_session):
    return ray_session


# ---- round trip ------------------------------------------------------------------------------
@pytest.mark.parametrize("num_computed", [0, 2 * BLOCK_SIZE])
def test_round_trip_copies_exact_bytes_into_scattered_blocks(ray, num_computed):
    producer = make_producer()
    ack_log = AckLog({"prefill-0": producer})
    consumer = make_consumer(ack_log)
    num_prompt = 4 * BLOCK_SIZE - 2  # partial last block
    src_blocks = [7, 8, 2, 3]  # two runs on P
    delay_free, params = producer.request_finished(finished_prefill("p1", num_prompt), src_blocks)
    assert delay_free and params.do_remote_prefill and params.num_tokens == num_prompt
    assert params.remote_engine_id == "prefill-0" and params.remote_request_id == "p1"
    assert isinstance(params.handle, RayKVHandle) and params.handle.run_lengths == (2, 2)
    object_id = params.handle.ref.hex()

    dst_blocks = [5, 1, 2, 9, 0]  # non-contiguous; one spare block for the decode
    request = make_request("d1", num_prompt + 1, params)
    assert consumer.get_num_new_matched_tokens(request, num_computed) == (
        num_prompt - num_computed,
        True,
    )
    outcome, recving, failed = load(consumer, request, dst_blocks, num_computed)
    assert outcome == "landed" and recving == {"d1"} and not failed

    src_pool, dst_pool = producer._blocks.tensor, consumer._blocks.tensor
    first = num_computed // BLOCK_SIZE
    for src, dst in zip(src_blocks[first:], dst_blocks[first:4], strict=True):
        assert torch.equal(dst_pool[dst], src_pool[src])
    untouched = set(range(dst_pool.shape[0])) - set(dst_blocks[first:4])
    assert all(not dst_pool[b].any() for b in untouched)
    assert ack_log.acks == [("prefill-0", "p1")]
    assert request.kv_transfer_params.handle.ref is None  # the load held the only ref

    assert drain_sends(producer) == ["p1"]
    stats = producer.stats()
    assert stats.num_pending_sends == 0 and stats.kv_transfer.acks_ignored == 0
    assert consumer.stats().num_pending_recvs == 0
    assert consumer.stats().kv_transfer.bytes_received > 0
    del params
    assert wait_until(lambda: not our_objects_in_store([object_id]))


def test_local_object_lands_at_the_first_get_finished(ray):
    """On one node the object is in the local store already: no polling, so the engine core's
    poll right after start_load_kv finds it landed and the request runs in that same step."""
    producer = make_producer()
    ack_log = AckLog({"prefill-0": producer})
    consumer = make_consumer(ack_log)
    _, params = producer.request_finished(finished_prefill("p1", 2 * BLOCK_SIZE), [4, 5])
    request = make_request("d1", 2 * BLOCK_SIZE + 1, params)
    num_external, _ = consumer.get_num_new_matched_tokens(request, 0)
    consumer.update_state_after_alloc(request, [1, 2, 3], num_external)
    consumer.start_load_kv(consumer.build_connector_meta(None))
    assert consumer.get_finished(set()) == (set(), {"d1"})
    assert ack_log.acks == [("prefill-0", "p1")]
    assert torch.equal(consumer._blocks.tensor[1:3], producer._blocks.tensor[4:6])
    assert consumer.stats().num_pending_recvs == 0 and not consumer.has_pending()
    assert drain_sends(producer) == ["p1"]


def test_bf16_pool_round_trip(ray):
    producer = RayKVConnector("prefill-bf16", "producer", BLOCK_SIZE)
    producer.register_kv_caches(make_pool(6, seed=3, dtype=torch.bfloat16))
    consumer = RayKVConnector("decode-bf16", "consumer", BLOCK_SIZE, ack_sender=AckLog())
    consumer.register_kv_caches(make_pool(6, dtype=torch.bfloat16))
    _, params = producer.request_finished(finished_prefill("b1", 2 * BLOCK_SIZE), [4, 1])
    outcome, _, _ = load(consumer, make_request("b1", 2 * BLOCK_SIZE + 1, params), [0, 5, 2])
    assert outcome == "landed"
    assert torch.equal(consumer._blocks.tensor[0], producer._blocks.tensor[4])
    assert torch.equal(consumer._blocks.tensor[5], producer._blocks.tensor[1])


# ---- a draft model's KV (speculative method draft_model) -------------------------------------
def draft_pool(num_blocks: int, seed: int | None = None, num_layers: int = 1) -> torch.Tensor:
    shape = (num_blocks, num_layers, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if seed is None:
        return torch.zeros(shape)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("producer_draft", "consumer_draft", "num_computed", "carried"),
    [(1, 1, 0, True), (1, None, 0, False), (None, 1, 0, False), (2, 1, 0, False),
     (1, 1, BLOCK_SIZE, False)],
    ids=["both-draft", "only-producer", "only-consumer", "other-draft-layout",
         "after-a-cached-prefix"],
)  # fmt: skip
def test_draft_kv_travels_with_the_target_kv_where_both_sides_draft_alike(
    ray, producer_draft, consumer_draft, num_computed, carried
):
    """A producer that drafts publishes its draft model's blocks after the target's; a
    consumer whose draft has the same layout copies them into its draft blocks and reports
    the tokens once, any other consumer copies the target's only and reports none. So does
    a load after a prefix of the consumer's own cache, whose draft KV nobody vouches for."""
    producer = RayKVConnector("prefill-0", "producer", BLOCK_SIZE)
    p_draft = None if producer_draft is None else draft_pool(16, 5, producer_draft)
    producer.register_kv_caches(make_pool(16, 0), p_draft)
    consumer = RayKVConnector("decode-0", "consumer", BLOCK_SIZE, ack_sender=AckLog())
    c_draft = None if consumer_draft is None else draft_pool(12, None, consumer_draft)
    consumer.register_kv_caches(make_pool(12), c_draft)

    num_prompt = 3 * BLOCK_SIZE - 1
    src_blocks, dst_blocks = [7, 8, 2], [5, 1, 9, 0]
    _, params = producer.request_finished(finished_prefill("p1", num_prompt), src_blocks)
    assert (params.handle.draft_layout is not None) == (producer_draft is not None)
    request = make_request("d1", num_prompt + 1, params)
    assert load(consumer, request, dst_blocks, num_computed)[0] == "landed"

    first = num_computed // BLOCK_SIZE
    for src, dst in zip(src_blocks[first:], dst_blocks[first:3]):
        assert torch.equal(consumer._blocks.tensor[dst], producer._blocks.tensor[src])
        if carried:
            assert torch.equal(c_draft[dst], p_draft[src])
    if c_draft is not None and not carried:
        assert not c_draft.any()  # never written from an object of another layout
    assert consumer.take_loaded_draft_tokens("d1") == (num_prompt if carried else 0)
    assert consumer.take_loaded_draft_tokens("d1") == 0  # reported once


# ---- acks, leases, cancels -------------------------------------------------------------------
def test_duplicate_and_unknown_acks_are_ignored(ray):
    producer = make_producer()
    _, params = producer.request_finished(finished_prefill("p1", 5), [0, 1])
    object_id = params.handle.ref.hex()
    del params
    acker = threading.Thread(target=lambda: [producer.ack("p1", producer.epoch) for _ in range(2)])
    acker.start()  # acks arrive on the actor's RPC thread
    acker.join()
    producer.ack("never-sent", producer.epoch)
    assert drain_sends(producer) == ["p1"]
    producer.ack("p1", producer.epoch)
    assert drain_sends(producer) == []
    stats = producer.stats()
    assert stats.kv_transfer.acks_ignored == 3 and stats.kv_transfer.acks_received == 4
    assert wait_until(lambda: not our_objects_in_store([object_id]))


def test_lease_expiry_without_ack_then_late_ack_ignored(ray):
    producer = make_producer(lease_s=0.05)
    _, params = producer.request_finished(finished_prefill("p1", 5), [3, 4])
    object_id = params.handle.ref.hex()
    del params
    assert producer.get_finished(set()) == (set(), set())  # lease still running
    time.sleep(0.1)
    assert drain_sends(producer) == ["p1"]
    assert producer.stats().kv_transfer.leases_expired == 1
    producer.ack("p1", producer.epoch)  # the consumer read it after all
    assert producer.stats().kv_transfer.acks_ignored == 1  # counted even while the step loop idles
    assert drain_sends(producer) == []
    assert producer.stats().kv_transfer.acks_ignored == 1
    assert wait_until(lambda: not our_objects_in_store([object_id]))


def test_cancel_sends_reports_once_and_frees(ray):
    producer = make_producer()
    _, params_a = producer.request_finished(finished_prefill("a", 5), [0, 1])
    _, params_b = producer.request_finished(finished_prefill("b", 5), [2, 3])
    object_id = params_a.handle.ref.hex()
    del params_a
    producer.cancel_sends(["a", "unknown"])
    # Dropped at once, even if the step loop is idle; reported at the next get_finished.
    assert wait_until(lambda: not our_objects_in_store([object_id]))
    assert producer.stats().num_pending_sends == 1  # "b" still awaits its ack
    assert drain_sends(producer) == ["a"]
    producer.ack("a", producer.epoch)  # a consumer that read before the cancel: ignored
    assert drain_sends(producer) == []
    assert params_b.handle.ref.hex() in our_objects_in_store()
    assert producer.has_pending() and not producer.needs_polling()  # "b" awaits its ack
    producer.ack("b", producer.epoch)
    assert producer.has_pending()  # released, not yet reported: the step loop must poll
    assert producer.needs_polling()
    assert drain_sends(producer) == ["b"] and not producer.has_pending()
    assert not producer.needs_polling()


# ---- load failures ---------------------------------------------------------------------------
def test_load_whose_owner_died_fails_without_ack(ray, caplog):
    import numpy as np

    @ray.remote(num_cpus=0)
    class Publisher:
        def publish(self, shape):
            self.ref = ray.put([np.ones(shape, np.float32)])
            return [self.ref]

    producer = make_producer()
    _, params = producer.request_finished(finished_prefill("p1", 6), [0, 1])
    block_shape = (2, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    publisher = Publisher.remote()
    ref = ray.get(publisher.publish.remote(block_shape))[0]
    params = with_handle(params, ref=ref)
    ray.kill(publisher)
    # The owner's death has been processed once its object is gone from the local store.
    assert wait_until(lambda: not ray.wait([ref], timeout=0, fetch_local=True)[0])

    ack_log = AckLog()
    consumer = make_consumer(ack_log)
    with caplog.at_level(logging.WARNING, logger="pdcluster.connectors.ray_kv"):
        outcome, recving, failed = load(consumer, make_request("d1", 7, params), [3, 4])
    assert outcome == "failed" and failed == {"d1"} and not recving
    assert "OwnerDiedError" in caplog.text
    assert ack_log.acks == []
    assert consumer.get_failed_loads() == set()  # reported once
    assert consumer.get_num_new_matched_tokens(make_request("d1", 7, params), 0) == (0, False)
    assert consumer.stats().kv_transfer.num_failed_loads == 1


def test_load_timeout_fails(ray):
    @ray.remote(num_cpus=0)
    class Slow:
        def never_soon(self):
            time.sleep(30)

    slow = Slow.remote()
    producer = make_producer()
    _, params = producer.request_finished(finished_prefill("p1", 6), [0, 1])
    params = with_handle(params, ref=slow.never_soon.remote())
    ack_log = AckLog()
    consumer = make_consumer(ack_log, load_timeout_s=0.2)
    outcome, recving, failed = load(consumer, make_request("d1", 7, params), [3, 4])
    assert outcome == "failed" and not recving and ack_log.acks == []
    ray.kill(slow)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda p: with_handle(p, ref="not-a-ref"),
        lambda p: with_handle(p, run_lengths=(1,)),  # 1 block cannot hold 6 tokens
        lambda p: with_handle(p, block_shape=(2, 2, 8, 2, 8)),  # other block size
        lambda p: dataclasses.replace(p, num_tokens="six"),
        lambda p: dataclasses.replace(p, remote_engine_id=""),
        lambda p: dataclasses.replace(p, handle=KVHandle()),  # another connector's handle
    ],
)
def test_malformed_params_fail_the_load_without_crashing(ray, corrupt):
    producer = make_producer()
    _, params = producer.request_finished(finished_prefill("p1", 6), [0, 1])
    params = corrupt(params)
    ack_log = AckLog()
    consumer = make_consumer(ack_log)
    request = make_request("d1", 7, params)
    num_external, load_async = consumer.get_num_new_matched_tokens(request, 0)
    assert load_async and num_external > 0
    consumer.update_state_after_alloc(request, [3, 4], num_external)
    consumer.start_load_kv(consumer.build_connector_meta(None))
    assert consumer.get_finished(set()) == (set(), set())
    assert consumer.get_failed_loads() == {"d1"}
    assert consumer.get_failed_loads() == set() and ack_log.acks == []


def test_public_dict_form_is_checked_once_at_the_boundary():
    """vLLM's dict form converts to the typed params when the request is built; an unknown
    key or a wrong type is refused there, naming it."""
    request = make_request("p", 6, {"do_remote_decode": True})
    assert request.kv_transfer_params == KVTransferParams.remote_decode()
    with pytest.raises(ValueError, match="unexpected_key"):
        make_request("p", 6, {"do_remote_decode": True, "unexpected_key": 1})
    with pytest.raises(ValueError, match="num_tokens"):
        make_request("d", 7, {"do_remote_prefill": True, "num_tokens": "six"})
    params = KVTransferParams(do_remote_prefill=True, remote_engine_id="p", num_tokens=4)
    assert KVTransferParams.from_dict(params.to_dict()) == params


# ---- requests that are not remote ------------------------------------------------------------
def test_non_remote_requests_are_left_alone(ray):
    producer = make_producer()
    consumer = make_consumer(AckLog())
    plain = make_request("x", 6)
    plain.num_computed_tokens = 6
    plain.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert producer.request_finished(plain, [0, 1]) == (False, None)
    aborted = finished_prefill("y", 6, status=RequestStatus.FINISHED_ABORTED)
    assert producer.request_finished(aborted, [0, 1]) == (False, None)
    errored = finished_prefill("z", 6, status=RequestStatus.FINISHED_ERROR)
    assert producer.request_finished(errored, [0, 1]) == (False, None)
    assert consumer.request_finished(finished_prefill("w", 6), [0, 1]) == (False, None)
    assert producer.stats().kv_transfer.num_sends == 0

    assert consumer.get_num_new_matched_tokens(make_request("x", 6), 0) == (0, False)
    remote_params = {"do_remote_prefill": True, "handle": None}
    assert consumer.get_num_new_matched_tokens(make_request("x", 6, remote_params), 0) == (0, False)
    consumer.update_state_after_alloc(make_request("x", 6), [0, 1], 0)
    assert consumer.build_connector_meta(None).loads == []
    _, params = producer.request_finished(finished_prefill("p1", 6), [0, 1])
    assert producer.get_num_new_matched_tokens(make_request("d1", 7, params), 0) == (0, False)
    assert consumer.get_num_new_matched_tokens(make_request("d1", 7, params), 8) == (0, False)


def test_shutdown_drops_everything(ray):
    producer = make_producer()
    _, params = producer.request_finished(finished_prefill("p1", 6), [0, 1])
    object_id = params.handle.ref.hex()
    del params
    producer.shutdown()
    assert producer.stats().num_pending_sends == 0
    assert producer.get_finished(set()) == (set(), set())
    assert wait_until(lambda: not our_objects_in_store([object_id]))


# ---- layout helpers (no Ray) -----------------------------------------------------------------
def test_consecutive_runs_andsegments():
    assert consecutive_runs([7, 8, 2, 3, 4, 0]) == [(7, 2), (2, 3), (0, 1)]
    assert consecutive_runs([]) == []
    # Source blocks 1..4 of runs [2, 3] onto destination blocks 10, 11, 12, 5.
    assert plan_segments((2, 3), 1, [10, 11, 12, 5]) == [(0, 1, 10, 1), (1, 0, 11, 2), (1, 2, 5, 1)]


# ---- checked bytes, fenced epochs ------------------------------------------------------------
@pytest.fixture
def fault_injection(monkeypatch):
    monkeypatch.setenv(faults.ENV, "1")
    yield faults
    faults.disarm_all()


def test_fault_injection_is_refused_unless_the_process_enables_it(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    with pytest.raises(PermissionError, match=faults.ENV):
        faults.arm(faults.FaultSpec(faults.Fault.CORRUPT_KV))
    assert faults.strike(faults.Fault.CORRUPT_KV) is None


@pytest.mark.parametrize("num_computed", [0, 2 * BLOCK_SIZE])
def test_a_corrupt_object_fails_closed_and_is_recomputed_whatever_the_policy(
    ray, fault_injection, num_computed
):
    """One bit flipped in the object after P hashed it: D's load fails (acked, so that P
    frees at once), it counts, and the request is recomputed even under policy 'fail'."""
    producer = make_producer()
    ack_log = AckLog({"prefill-0": producer})
    consumer = make_consumer(ack_log)
    fault_injection.arm(faults.FaultSpec(faults.Fault.CORRUPT_KV))
    num_prompt = 4 * BLOCK_SIZE
    _, params = producer.request_finished(finished_prefill("p1", num_prompt), [7, 8, 2, 3])
    assert len(params.handle.digests) == 4 and params.handle.epoch == producer.epoch
    request = make_request("d1", num_prompt + 1, params)
    outcome, _, failed = load(consumer, request, [5, 1, 2, 9], num_computed)
    assert outcome == "failed" and failed == {"d1"}
    assert consumer.load_failure_recomputes(request)
    assert consumer.stats().kv_transfer.checksum_failures == 1
    assert ack_log.acks == [("prefill-0", "p1")] and drain_sends(producer) == ["p1"]
    # The next publish is not corrupt, and lands.
    _, params = producer.request_finished(finished_prefill("p2", num_prompt), [7, 8, 2, 3])
    assert load(consumer, make_request("d2", num_prompt + 1, params), [5, 1, 2, 9])[0] == "landed"


def test_an_ack_for_another_epoch_is_refused(ray):
    """A restarted producer keeps its name but not its epoch: an ack meant for its
    predecessor's handle (the same request id) never frees the successor's blocks."""
    predecessor = make_producer()
    _, old = predecessor.request_finished(finished_prefill("p1", 5), [0, 1])
    successor = make_producer()
    assert successor.epoch != predecessor.epoch
    _, params = successor.request_finished(finished_prefill("p1", 5), [0, 1])
    successor.ack("p1", old.handle.epoch)
    assert drain_sends(successor) == [] and successor.stats().num_pending_sends == 1
    assert successor.stats().kv_transfer.acks_refused == 1
    successor.ack("p1", params.handle.epoch)
    assert drain_sends(successor) == ["p1"]
    predecessor.shutdown()
