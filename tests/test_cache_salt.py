"""`cache_salt`: requests with different salts never share prefix blocks, in the engine's
prefix cache, the KV events instances publish, the router's prefix index and the P->D
handoff; equal salts (or none) share as before. Scheduler and router without Ray, then a
default (fcfs) 1P1D cluster through the gateway, which also refuses a priority there."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdcluster.engine import SamplingParams
from pdcluster.engine.kv_cache_manager import root_hash
from pdcluster.routing.fanout import fan_out
from pdcluster.routing.handoff import for_decode, for_prefill
from pdcluster.routing.policy import RouterConfig, RouterPolicy, block_hashes
from tests.cluster_utils import assert_clean, instance_stats, live_object_ids, start
from tests.scheduler_utils import (
    assert_idle,
    make_requests,
    make_runner_output,
    make_scheduler,
    run_until_done,
)

PROMPT = [300 + j for j in range(22)]  # 5 full blocks of 4, and 2 tokens
NUM_HIT = 20  # full blocks only, never the last token


def cached_tokens(scheduler, request_id: str, salt: str | None) -> int:
    """Run one request of PROMPT under `salt` to its end; its prefix-cache hit."""
    (request,) = make_requests(1, prompt_token_ids=PROMPT, id_prefix=request_id, cache_salt=salt)
    scheduler.add_request(request)
    outputs = run_until_done(scheduler)
    return outputs[request.request_id][0].num_cached_tokens


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        ("tenant-a", "tenant-b", 0),  # another tenant computes its whole prompt
        ("tenant-a", "tenant-a", NUM_HIT),  # the same tenant hits
        (None, None, NUM_HIT),  # unsalted requests share as before
        ("tenant-a", None, 0),  # a salted prefix is no unsalted one's
        (None, "tenant-a", 0),
    ],
)
def test_requests_share_prefix_blocks_only_under_equal_salts(first, second, expected):
    s = make_scheduler()
    assert cached_tokens(s, "a", first) == 0
    assert cached_tokens(s, "b", second) == expected
    assert_idle(s)


def test_different_salts_in_one_step_do_not_hit_each_others_fresh_blocks():
    s = make_scheduler()
    salts = ["tenant-a", "tenant-b", "tenant-a"]
    requests = [
        make_requests(1, prompt_token_ids=PROMPT, start=i, cache_salt=salt)[0]
        for i, salt in enumerate(salts)
    ]
    for request in requests:
        s.add_request(request)
    so = s.schedule()
    assert [n.num_computed_tokens for n in so.scheduled_new_reqs] == [0, 0, NUM_HIT]
    a_blocks = s.kv_cache_manager.get_block_ids("req0")
    b_blocks = s.kv_cache_manager.get_block_ids("req1")
    assert not set(a_blocks) & set(b_blocks)
    assert s.kv_cache_manager.get_block_ids("req2")[:5] == a_blocks[:5]
    s.update_from_output(so, make_runner_output(s, so))
    run_until_done(s)
    assert_idle(s)


def test_salt_changes_every_hash_of_the_chain_and_events_name_them():
    s = make_scheduler()
    pool = s.kv_cache_manager.block_pool
    pool.enable_kv_events()
    cached_tokens(s, "a", "tenant-a")
    stored = {h for is_stored, h in pool.take_kv_events() if is_stored}
    salted = block_hashes(PROMPT, 4, root=root_hash("tenant-a"))
    plain = block_hashes(PROMPT, 4)
    assert set(salted) <= stored  # the router computes what the instance publishes
    assert not stored & set(plain)
    assert not set(salted) & set(block_hashes(PROMPT, 4, root=root_hash("tenant-b")))
    assert_idle(s)


def test_router_does_not_follow_another_tenants_cached_prefix():
    policy = RouterPolicy({"P0": "prefill", "P1": "prefill", "D0": "decode"}, RouterConfig(4))
    # P0 published tenant A's blocks of the prompt, and has a little more queued than P1.
    policy.apply_kv_events("P0", block_hashes(PROMPT, 4, root=root_hash("tenant-a")), [], False)
    policy.on_prefill_start("P0", [1, 2, 3])
    assert policy.plan(PROMPT, root=root_hash("tenant-a")).prefill_id == "P0"  # A's prefix there
    assert policy.plan(PROMPT, root=root_hash("tenant-b")).prefill_id == "P1"  # least loaded
    assert policy.plan(PROMPT).prefill_id == "P1"


def test_router_remembers_what_it_sent_under_the_requests_salt():
    policy = RouterPolicy({"P0": "prefill", "P1": "prefill", "D0": "decode"}, RouterConfig(4))
    policy.on_prefill_start("P0", PROMPT, root=root_hash("tenant-a"))
    assert policy.plan(PROMPT, root=root_hash("tenant-a")).prefill_id == "P0"
    assert policy.plan(PROMPT, root=root_hash("tenant-b")).prefill_id == "P1"


def test_salt_and_priority_travel_with_the_handoff_and_fan_out():
    (request,) = make_requests(1, prompt_token_ids=PROMPT, cache_salt="tenant-a", priority=-3)
    prefill = for_prefill(request)
    decode = for_decode(request, 7, {"remote_request_id": "req0"})
    children = fan_out(request, 2)
    for r in (prefill, decode, *children):
        assert (r.cache_salt, r.priority) == ("tenant-a", -3)


# ---- through the gateway, on 1P1D -------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(ray_session, model_dir):
    # Prefill on P even when D caches the prompt: the test reads P's prefix cache.
    router = {"decode_prefix_fraction": 1.0}
    with start(model_dir, prefill=1, decode=1, router=router) as c:
        yield c


def test_tenants_prompts_are_cached_apart_on_p_and_in_the_router(cluster, base_url):
    baseline = live_object_ids()
    prompt = "Tenants keep their caches apart. " * 4
    token_ids = cluster.tokenizer.encode(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def p_cached_tokens(salt: str) -> int:
        """P's prefix-cache hit for the prompt under `salt` (its first output carries it)."""
        request = cluster.make_request(prompt, params, cache_salt=salt)
        return asyncio.run(_first_cached(cluster, request))

    block_size = cluster.config.engine.block_size
    num_full = (len(token_ids) - 1) // block_size * block_size
    assert p_cached_tokens("tenant-a") == 0
    assert p_cached_tokens("tenant-a") == num_full  # the same tenant's repeat hits
    assert p_cached_tokens("tenant-b") == 0  # another tenant computes its whole prompt

    # The router's index of P (fed by P's KV events) names A's and B's blocks, never as
    # each other's: tenant C, whose blocks nobody cached, finds no prefix there.
    policy = cluster.front.policy
    (p_id,) = [i for i, (role, _) in cluster.instances.items() if role == "prefill"]
    index = policy.instances[p_id].cached_blocks
    for salt in ("tenant-a", "tenant-b"):
        assert block_hashes(token_ids, block_size, root=root_hash(salt))[0] in index
    assert block_hashes(token_ids, block_size, root=root_hash("tenant-c"))[0] not in index
    assert_clean(cluster, baseline)


async def _first_cached(cluster, request) -> int:
    num_cached = None
    async for out in cluster.stream(request):
        num_cached = out.num_cached_tokens if num_cached is None else num_cached
    return num_cached


def test_gateway_passes_the_salt_to_the_instances(cluster, base_url):
    baseline = live_object_ids()
    body = {"model": cluster.model_name, "prompt": "Salted through HTTP. " * 4, "max_tokens": 2}

    def p_hits_after(salt: str) -> int:
        before = instance_stats(cluster, "prefill").scheduler.prefix_cache_hits
        response = httpx.post(f"{base_url}/v1/completions", json={**body, "cache_salt": salt})
        assert response.status_code == 200, response.text
        return instance_stats(cluster, "prefill").scheduler.prefix_cache_hits - before

    assert p_hits_after("http-a") == 0
    assert p_hits_after("http-a") > 0
    assert p_hits_after("http-b") == 0
    assert_clean(cluster, baseline)


@pytest.mark.parametrize("salt", ["", 5, ["a"]])
def test_a_salt_that_is_not_a_non_empty_string_is_a_400(cluster, base_url, salt):
    body = {"model": cluster.model_name, "prompt": "x", "max_tokens": 1, "cache_salt": salt}
    response = httpx.post(f"{base_url}/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "cache_salt"


def test_a_priority_on_this_fcfs_cluster_is_a_400_naming_the_field(cluster, base_url):
    body = {"model": cluster.model_name, "prompt": "x", "max_tokens": 1, "priority": 1}
    response = httpx.post(f"{base_url}/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "priority" and "scheduling_policy" in error["message"]
    zero = httpx.post(f"{base_url}/v1/completions", json={**body, "priority": 0})
    assert zero.status_code == 200, zero.text
