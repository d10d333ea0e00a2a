"""The cluster KV pool: its index (no Ray), and engines sharing prefixes through a real owner
actor on the session's Ray: a prefix computed on one instance loads on another, eviction,
and an owner lost mid-load (recompute)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import ray

from pdcluster.actors.kv_pool import KVPoolActor
from pdcluster.actors.pool_messages import KVPoolStats
from pdcluster.connectors import faults
from pdcluster.connectors.kv_pool_index import KVPoolIndex, PoolPublish
from pdcluster.connectors.ray_kv_pool import RayKVPoolConnector
from pdcluster.connectors.stats import KVPoolUse
from pdcluster.engine import LLM, SamplingParams
from pdcluster.routing.policy import RouterConfig, RouterPolicy, block_hashes
from tests.cluster_utils import assert_clean, kv_pool_actor, live_object_ids, start, wait_until

BLOCK_SIZE = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(5, 42))  # 37 tokens: 9 full blocks
RESTART_TIMEOUT_S = 120.0  # a restarted instance loads its model again


# ---- the index ---------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def entry(block_hashes: list[int], ref: str, run_lengths: tuple[int, ...], nbytes: int):
    """A publish of layout "L" whose object is named `ref`."""
    return PoolPublish("L", tuple(block_hashes), [ref], run_lengths, nbytes)


def test_a_hit_is_the_longest_run_from_the_first_hash_across_entries():
    index = KVPoolIndex(capacity_bytes=1000, pin_s=10)
    assert index.add(entry([1, 2, 3], "a", (2, 1), 30))
    assert index.add(entry([4, 5], "b", (2,), 20))
    hit = index.lookup("L", [2, 3, 4, 9, 5])
    assert [(p.refs, p.first_row, p.num_blocks) for p in hit.parts] == [
        (["a"], 1, 2),
        (["b"], 0, 1),
    ]
    assert index.lookup("other layout", [1, 2]).num_blocks == 0
    assert index.lookup("L", [7, 1]).num_blocks == 0


def test_eviction_is_lru_and_spares_pinned_entries():
    clock = Clock()
    index = KVPoolIndex(capacity_bytes=100, pin_s=5, clock=clock)
    index.add(entry([1], "a", (1,), 40))
    index.add(entry([2], "b", (1,), 40))
    pinned = index.lookup("L", [1])  # pins "a" and makes it the most recently used
    assert index.add(entry([3], "c", (1,), 40))  # evicts "b", not the pinned "a"
    assert index.lookup("L", [2]).num_blocks == 0
    assert not index.add(entry([4], "d", (1,), 70))  # would not fit even without "c"
    assert index.lookup("L", [3]).num_blocks == 1  # so "c" was kept
    index.release(pinned.lookup_id)
    assert index.add(entry([4], "d", (1,), 60))  # evicts "a", the least recently used
    assert index.lookup("L", [1]).num_blocks == 0
    stats = index.stats()
    assert (stats["num_entries"], stats["num_bytes"], stats["num_evictions"]) == (2, 100, 2)
    assert index.add(entry([5], "e", (1,), 40))
    lost = index.lookup("L", [5])
    clock.now = 6  # a reader that never released: its pin lease ran out
    assert index.add(entry([6], "f", (1,), 70))
    assert index.lookup("L", [5]).num_blocks == 0 and lost.num_blocks == 1


def test_an_entry_of_blocks_held_already_or_too_large_is_not_kept():
    index = KVPoolIndex(capacity_bytes=100, pin_s=5)
    assert index.add(entry([1, 2], "a", (2,), 20))
    assert not index.add(entry([1, 2], "b", (2,), 20))
    assert not index.add(entry([9], "c", (1,), 101))
    assert index.add(entry([1, 2, 3], "d", (3,), 30))  # block 3 is new
    hit = index.lookup("L", [1, 2, 3])
    assert [(p.refs, p.first_row, p.num_blocks) for p in hit.parts] == [
        (["a"], 0, 2),
        (["d"], 2, 1),
    ]
    with pytest.raises(ValueError):
        index.add(entry([1, 2], "e", (3,), 1))


def test_the_owner_reports_its_index_and_its_publishes_as_one_kv_pool_stats():
    owner = KVPoolActor(capacity_bytes=100, pin_s=5)  # the plain class: no Ray
    owner.index.add(entry([1, 2], "a", (2,), 20))
    stats = asyncio.run(owner.stats())
    assert isinstance(stats, KVPoolStats)
    assert (stats.num_entries, stats.num_blocks, stats.num_bytes) == (1, 2, 20)
    assert stats.to_dict()["capacity_bytes"] == 100 and stats.num_failed_publishes == 0


# ---- routing with the pool's tier --------------------------------------------------------------
def test_a_prefix_the_pool_holds_draws_requests_less_than_one_only_a_p_holds():
    shared, tail = list(range(1000, 1032)), list(range(9000, 9008))  # 8 blocks, then 2
    policy = RouterPolicy(
        {"P0": "prefill", "P1": "prefill", "D0": "decode"},
        RouterConfig(block_size=BLOCK_SIZE, prefix_slack_tokens=48),
    )
    policy.on_prefill_start("P0", shared)  # P0 caches the prefix and queues 32 tokens
    assert policy.plan(shared + tail).prefill_id == "P0"  # 32 <= 48 of slack
    hashes = block_hashes(shared, BLOCK_SIZE)
    policy.apply_pool_events(hashes, [], reset=False)
    # P1 would load the prefix from the pool: P0 is worth half the slack (24 < 32) now.
    assert policy.plan(shared + tail).prefill_id == "P1"
    policy.apply_pool_events([], hashes[4:], reset=False)  # the pool lost its second half
    assert policy.plan(shared + tail).prefill_id == "P0"  # (8 - 4 * 0.5) / 8 * 48 = 36 >= 32
    policy.apply_pool_events([], [], reset=True)
    assert not policy.pool_blocks


# ---- engines sharing a pool --------------------------------------------------------------------
@pytest.fixture
def make_pool(ray_session):
    """Factory of owner actors (capacity in bytes); every one is killed after the test."""
    actors = []

    def make(capacity_bytes: int = 256 * 1024 * 1024):
        actor = ray.remote(KVPoolActor).options(num_cpus=0).remote(capacity_bytes, 30.0)
        actors.append(actor)
        return actor

    yield make
    for actor in actors:
        ray.kill(actor, no_restart=True)


def pooled_llm(path: str, pool, **engine_args) -> LLM:
    """An offline engine whose KV connector is the pool's."""
    return LLM(
        path,
        kv_connector=RayKVPoolConnector(pool, BLOCK_SIZE),
        block_size=BLOCK_SIZE,
        **engine_args,
    )


def run(llm: LLM, prompt: list[int]):
    return llm.generate({"prompt_token_ids": prompt}, PARAMS)[0]


def pool_stats(pool) -> KVPoolStats:
    return ray.get(pool.stats.remote())


def pool_use(llm: LLM) -> KVPoolUse:
    """The engine's use of the pool, as its stats carry it."""
    return llm.engine.stats()["kv_pool"]


def assert_all_free(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert stats["kv_pool"].pending_loads == 0


@pytest.fixture(scope="module")
def reference(preset_dir):
    """Colocated, no prefix cache and no pool: the tokens every path must match."""
    llm = LLM(preset_dir("tiny-llama"), block_size=BLOCK_SIZE, enable_prefix_caching=False)
    return lambda prompt: run(llm, prompt).outputs[0].token_ids


def test_a_prefix_computed_on_one_instance_is_loaded_on_another(preset_dir, make_pool, reference):
    path, pool = preset_dir("tiny-llama"), make_pool()
    first, second = pooled_llm(path, pool), pooled_llm(path, pool)
    empty = ray.get(pool.events.remote())
    waiting = pool.events.remote(empty.epoch, empty.cursor, 600.0)  # a router's long-poll
    turn1 = run(first, PROMPT)
    assert turn1.outputs[0].token_ids == reference(PROMPT)
    # The first instance published prompt and output: 37 + 6 tokens, 10 full blocks computed.
    assert wait_until(lambda: pool_stats(pool).num_blocks == 10)
    woken = ray.get(waiting, timeout=60)  # answered at the first publish, not after 600 s
    assert woken.stored and not woken.reset and woken.epoch == empty.epoch

    follow_up = [*PROMPT, *turn1.outputs[0].token_ids, 7, 8, 9]
    turn2 = run(second, follow_up)
    assert turn2.outputs[0].token_ids == reference(follow_up)
    assert turn2.num_cached_tokens == 40  # every full block the first computed, the reply's too
    stats = second.engine.stats()
    assert (stats["kv_pool"].hits, stats["kv_pool"].hit_tokens) == (1, 40)
    assert stats["prefix_cache_hits"] == 0  # nothing came from its own cache
    again = run(second, [*follow_up, 10])  # now from its own prefix cache, not the pool
    assert again.num_cached_tokens >= 40 and pool_use(second).hits == 1
    for llm in (first, second):
        assert_all_free(llm)
    assert pool_stats(pool).num_pinned_entries == 0


def test_a_corrupt_pool_entry_is_recomputed_and_counted(
    preset_dir, make_pool, reference, monkeypatch
):
    """A bit flipped in a published entry after it was hashed: the reader's load fails its
    checksum and the request is recomputed, even under policy 'fail' (a cache never fails a
    request)."""
    monkeypatch.setenv(faults.ENV, "1")
    path, pool = preset_dir("tiny-llama"), make_pool()
    faults.arm(faults.FaultSpec(faults.Fault.CORRUPT_POOL_ENTRY))
    try:
        run(pooled_llm(path, pool), PROMPT)
    finally:
        faults.disarm_all()
    assert wait_until(lambda: pool_stats(pool).num_entries == 1)
    reader = pooled_llm(path, pool, kv_load_failure_policy="fail")
    out = run(reader, [*PROMPT, 1])
    assert out.outputs[0].token_ids == reference([*PROMPT, 1])
    use = pool_use(reader)
    assert (use.hits, use.failed_loads, use.checksum_failures, use.loads) == (1, 1, 1, 0)
    assert_all_free(reader)
    assert pool_stats(pool).num_pinned_entries == 0


def test_a_release_for_another_incarnation_of_the_pool_is_refused(make_pool):
    """Lookup ids start again in a restarted pool: a reader's release of a pin from the
    previous incarnation must not unpin another reader's entry."""
    pool = make_pool()
    entry = PoolPublish("layout", (1, 2), [ray.put([np.zeros((2, 4), np.float32)])], (2,), 64)
    assert ray.get(pool.publish.remote(entry))
    hit = ray.get(pool.lookup.remote("layout", [1, 2]))
    assert hit.num_blocks == 2 and hit.epoch
    ray.get(pool.release.remote(hit.lookup_id, "another-incarnation"))
    stats = pool_stats(pool)
    assert (stats.num_pinned_entries, stats.num_refused_releases) == (1, 1)
    ray.get(pool.release.remote(hit.lookup_id, hit.epoch))
    assert pool_stats(pool).num_pinned_entries == 0


def test_a_small_pool_evicts_the_least_recently_used(preset_dir, make_pool, reference):
    path = preset_dir("tiny-llama")
    probe = pooled_llm(path, make_pool())
    run(probe, PROMPT)
    entry_bytes = pool_use(probe).bytes_published
    pool = make_pool(int(entry_bytes * 1.5))  # room for one such entry, not two
    writer = pooled_llm(path, pool)
    other = [p + 100 for p in PROMPT]
    run(writer, PROMPT)
    assert wait_until(lambda: pool_stats(pool).num_entries == 1)
    run(writer, other)
    assert wait_until(lambda: pool_stats(pool).num_evictions == 1)
    assert pool_stats(pool).num_bytes <= pool_stats(pool).capacity_bytes

    reader = pooled_llm(path, pool)
    kept = run(reader, [*other, 1])  # first: its publish (2 new blocks) evicts nothing
    evicted = run(reader, [*PROMPT, 1])
    assert (evicted.num_cached_tokens, kept.num_cached_tokens) == (0, 36)
    assert evicted.outputs[0].token_ids == reference([*PROMPT, 1])
    assert kept.outputs[0].token_ids == reference([*other, 1])
    assert pool_use(reader).misses == 1
    assert_all_free(reader)


def test_instances_with_and_without_a_draft_model_share_entries(preset_dir, make_pool, reference):
    """Entries hold the target's KV only: an instance with a draft model (speculative method
    draft_model) reads a plain one's, and its draft model catches the loaded prefix up."""
    path, pool = preset_dir("tiny-llama"), make_pool()
    run(pooled_llm(path, pool), PROMPT)
    assert wait_until(lambda: pool_stats(pool).num_entries == 1)
    drafting = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    reader = pooled_llm(path, pool, speculative_config=drafting)
    out = run(reader, [*PROMPT, 1])
    assert out.outputs[0].token_ids == reference([*PROMPT, 1])
    assert out.num_cached_tokens > 0 and pool_use(reader).hits == 1
    drafts = reader.engine.stats()["spec_decode"]  # the target drafting for itself
    assert drafts.num_accepted_tokens == drafts.num_draft_tokens > 0
    assert drafts.num_catch_up_tokens >= out.num_cached_tokens
    assert_all_free(reader)


def test_an_object_lost_mid_load_means_recompute_and_a_lost_owner_misses(
    preset_dir, make_pool, reference
):
    path, pool = preset_dir("tiny-llama"), make_pool()
    run(pooled_llm(path, pool), PROMPT)
    assert wait_until(lambda: pool_stats(pool).num_entries == 1)
    reader = pooled_llm(path, pool, kv_load_failure_policy="fail")  # a handoff's, not a cache's
    connector = reader.engine.kv_connector
    start_load_kv = connector.start_load_kv

    def objects_lost_first(metadata):  # the hit was answered; its objects are gone now
        for load in metadata or ():
            load.parts = [part._replace(ref=lost_object()) for part in load.parts]
        start_load_kv(metadata)

    connector.start_load_kv = objects_lost_first
    out = run(reader, [*PROMPT, 1])
    assert out.outputs[0].token_ids == reference([*PROMPT, 1])
    use = pool_use(reader)
    assert (use.hits, use.failed_loads, use.loads) == (1, 1, 0)
    assert_all_free(reader)
    # With the owner gone, lookups fail fast and count as misses: nothing waits on it.
    ray.kill(pool, no_restart=True)
    assert wait_until(lambda: _dead(pool))
    assert run(reader, [p + 1 for p in PROMPT]).outputs[0].token_ids == reference(
        [p + 1 for p in PROMPT]
    )
    assert pool_use(reader).misses == 1


@ray.remote(num_cpus=0)
class _Never:
    async def value(self) -> None:
        await asyncio.sleep(3600)


def lost_object() -> ray.ObjectRef:
    """A reference whose object will never exist: its creator died first. (On one node an
    owner's death does not lose an object a borrower still references, so the test cannot
    lose a pooled object any other way.)"""
    creator = _Never.remote()
    ref = creator.value.remote()
    ray.kill(creator, no_restart=True)
    return ref


def _dead(actor) -> bool:
    try:
        ray.get(actor.stats.remote(), timeout=5)
    except ray.exceptions.RayActorError:
        return True
    return False


# ---- a cluster ---------------------------------------------------------------------------------
def test_after_its_p_is_killed_a_follow_up_turn_loads_prompt_and_reply_from_the_pool(
    ray_session, preset_dir, reference
):
    """2P1D: turn 1's P published the prompt, D the reply; that P is killed (and restarts
    cold). Turn 2 is computed from the pool on whichever P serves it, token for token."""
    path = preset_dir("tiny-llama")
    # decode_prefix_fraction 1: turn 2 is prefilled on a P, never on D from D's own cache.
    with start(path, prefill=2, decode=1, router={"decode_prefix_fraction": 1.0}) as cluster:
        pool = kv_pool_actor(cluster)
        turn1 = cluster.generate([{"prompt_token_ids": PROMPT}], PARAMS)[0]
        assert turn1.token_ids == reference(PROMPT)
        # P published the prompt's 9 full blocks, D the block its reply filled.
        assert wait_until(lambda: pool_stats(pool).num_blocks == 10)
        assert wait_until(lambda: len(cluster.front.policy.pool_blocks) == 10)  # the router's view
        first_p = next(s for s in cluster.stats() if s.role == "prefill" and s.kv_pool.publishes)
        ray.kill(cluster.instances[first_p.instance_id][1], no_restart=False)
        assert wait_until(lambda: _restarted(cluster, first_p), RESTART_TIMEOUT_S)
        baseline = live_object_ids()

        follow_up = [*PROMPT, *turn1.token_ids, 7, 8, 9]
        turn2 = cluster.generate([{"prompt_token_ids": follow_up}], PARAMS)[0]
        assert turn2.token_ids == reference(follow_up)
        prefills = [s for s in cluster.stats() if s.role == "prefill"]
        # No live P holds any of it: all 10 blocks, the reply's included, came from the pool.
        assert sum(s.kv_pool.hit_tokens for s in prefills) == 40
        assert sum(s.scheduler.prefix_cache_hits for s in prefills) == 0
        assert_clean(cluster, baseline)
        assert pool_stats(pool).num_pinned_entries == 0
        held = set(ray.get(pool.object_ids.remote()))
        assert held

        # The pool's owner dies (as with its node): Ray restarts it empty; turns recompute
        # what it held, token for token, and publish again.
        ray.kill(pool, no_restart=False)
        assert wait_until(lambda: _answers_empty(pool), RESTART_TIMEOUT_S)
        turn3 = cluster.generate([{"prompt_token_ids": [*follow_up, 5]}], PARAMS)[0]
        assert turn3.token_ids == reference([*follow_up, 5])
        assert wait_until(lambda: pool_stats(pool).num_entries > 0)
        assert_clean(cluster, baseline)
        held = set(ray.get(pool.object_ids.remote()))
    assert wait_until(lambda: not held & live_object_ids())  # the pool ended with the cluster


def _answers_empty(pool) -> bool:
    try:
        return ray.get(pool.stats.remote(), timeout=5).num_entries == 0
    except ray.exceptions.RayError:  # restarting
        return False


def _restarted(cluster, before: dict) -> bool:
    now = next(s for s in cluster.stats() if s.instance_id == before.instance_id)
    return now.healthy and now.pid not in (None, before.pid)


def test_kv_pool_size_flag_and_default():
    from pdcluster.cluster.cli import build_parser
    from pdcluster.cluster.serve_flags import load_serve_config

    def serve_config(*flags: str):
        return load_serve_config(build_parser().parse_args(["serve", *flags]))

    assert serve_config().connector.kv_pool_size_gib is None  # on: a share of the store
    assert serve_config("--kv-pool-size", "0").connector.kv_pool_size_gib == 0  # off
    assert serve_config("--kv-pool-size", "1.5").connector.kv_pool_size_gib == 1.5
    with pytest.raises(ValueError, match="kv_pool_size_gib"):
        serve_config("--kv-pool-size", "-1")
