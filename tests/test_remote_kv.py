"""RemoteKV on its own (no scheduler, no Ray): parking a load, its landing, failure under
each policy, an abort while loading, a producer's delayed free until its send ends."""

from __future__ import annotations

import pytest

from pdcluster.engine.config import CacheConfig
from pdcluster.engine.kv_cache_manager import KVCacheManager
from pdcluster.engine.outputs import KVConnectorOutput, SchedulerOutput
from pdcluster.engine.remote_kv import RemoteKV
from pdcluster.engine.request import RequestStatus
from tests.scheduler_utils import FakeKVConnector, make_requests

BLOCK_SIZE, NUM_BLOCKS = 4, 16


def make_remote_kv(connector: FakeKVConnector, policy: str = "recompute") -> RemoteKV:
    kv = KVCacheManager(CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS))
    return RemoteKV(connector, kv, policy)


def parked(remote: RemoteKV, num_tokens: int = 12, num_external: int = 12, start: int = 0):
    request = make_requests(1, num_tokens, start=start)[0]
    assert remote.park(request, [], 0, num_external)
    return request, {request.request_id: request}


def test_park_holds_blocks_for_the_whole_prompt_and_tells_the_connector():
    connector = FakeKVConnector({"req0": 12})
    remote = make_remote_kv(connector)
    request, _ = parked(remote)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert remote.is_loading("req0")
    block_ids = remote.kv_cache_manager.get_block_ids("req0")
    assert len(block_ids) == 3
    assert connector.allocs == [("req0", block_ids, 12)]


def test_park_refuses_when_blocks_do_not_fit():
    remote = make_remote_kv(FakeKVConnector())
    request = make_requests(1, BLOCK_SIZE * (NUM_BLOCKS + 1))[0]
    assert not remote.park(request, [], 0, BLOCK_SIZE * NUM_BLOCKS)
    assert request.status == RequestStatus.WAITING and not remote.is_loading("req0")


def test_landed_load_resumes_with_all_but_the_last_token_computed_and_asks_no_more():
    connector = FakeKVConnector({"req0": 12})
    remote = make_remote_kv(connector)
    request, requests = parked(remote)
    events = remote.update(KVConnectorOutput(finished_recving={"req0"}), requests)
    assert not events.to_free and not events.failed
    assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 11
    assert not remote.is_loading("req0")
    assert remote.match(request, 0) == (0, False)  # holds its blocks: never asked again
    assert connector.num_queries == 0


@pytest.mark.parametrize("recomputes", [False, True])
def test_failed_load_recomputes_under_recompute_policy(recomputes):
    connector = FakeKVConnector({"req0": 12})
    connector.load_failure_recomputes = lambda request: recomputes
    remote = make_remote_kv(connector, "recompute")
    request, requests = parked(remote)
    events = remote.update(KVConnectorOutput(failed_recving={"req0"}), requests)
    assert not events.to_free and not events.failed
    assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
    assert "req0" not in remote.kv_cache_manager.req_to_blocks  # prefilled here from scratch
    assert remote.match(request, 0) == (0, False)


def test_failed_load_ends_the_request_under_fail_policy_unless_the_connector_recomputes():
    connector = FakeKVConnector({"req0": 12})
    remote = make_remote_kv(connector, "fail")
    request, requests = parked(remote)
    events = remote.update(KVConnectorOutput(failed_recving={"req0"}), requests)
    assert events.failed == [request] and not events.to_free
    assert (
        request.status == RequestStatus.FINISHED_ERROR and "kv_load_failure_policy" in request.error
    )

    connector.load_failure_recomputes = lambda request: True  # a cache's load: never fails
    cached, requests = parked(remote, start=1)
    events = remote.update(KVConnectorOutput(failed_recving={"req1"}), requests)
    assert not events.failed and cached.status == RequestStatus.WAITING


@pytest.mark.parametrize("landing", ["finished_recving", "failed_recving"])
def test_abort_while_loading_frees_only_once_the_load_ended(landing):
    remote = make_remote_kv(FakeKVConnector({"req0": 12}))
    request, requests = parked(remote)
    request.status = RequestStatus.FINISHED_ABORTED
    remote.abort_load("req0")
    assert remote.num_aborted_loads == 1
    assert not remote.update(KVConnectorOutput(), requests).to_free  # still loading
    events = remote.update(KVConnectorOutput(**{landing: {"req0"}}), requests)
    assert events.to_free == [request] and not events.failed
    assert remote.num_aborted_loads == 0


def test_producer_holds_blocks_until_its_send_ends_then_once():
    connector = FakeKVConnector(delay_free=True)
    remote = make_remote_kv(connector)
    request = make_requests(1, 8)[0]
    remote.kv_cache_manager.allocate_slots(request, 8)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay_free, params = remote.request_finished(request)
    assert delay_free and params.remote_request_id == "req0"
    assert connector.finished == [("req0", remote.kv_cache_manager.get_block_ids("req0"))]
    assert remote.is_sending("req0") and remote.num_pending_sends == 1
    requests = {"req0": request}
    events = remote.update(KVConnectorOutput(finished_sending={"req0"}), requests)
    assert events.to_free == [request] and remote.num_pending_sends == 0
    assert not remote.update(KVConnectorOutput(finished_sending={"req0"}), requests).to_free


def test_synchronous_load_is_published_after_the_step_that_ran_it():
    connector = FakeKVConnector({"req0": 8}, load_async=False)
    remote = make_remote_kv(connector)
    request = make_requests(1, 12)[0]
    kv = remote.kv_cache_manager
    kv.allocate_slots(request, 4, 0, [], 8)
    remote.admitted(request, 8)
    assert connector.allocs == [("req0", kv.get_block_ids("req0"), 8)]
    request.status, request.num_computed_tokens = RequestStatus.RUNNING, 12
    ran = SchedulerOutput.empty()
    ran.num_scheduled_tokens["req0"] = 4
    remote.publish_loaded_blocks(ran)
    assert kv.block_pool.get_num_free_blocks() < kv.block_pool.num_usable_blocks
    other = make_requests(1, 12, prompt_token_ids=request.prompt_token_ids, id_prefix="x")[0]
    assert kv.get_computed_blocks(other)[1] == 8  # the loaded blocks are prefix hits now


def test_forget_drops_every_trace():
    remote = make_remote_kv(FakeKVConnector({"req0": 12}))
    request, _ = parked(remote)
    remote.abort_load("req0")
    remote.forget("req0")
    assert not remote.is_loading("req0") and remote.num_aborted_loads == 0
