"""BlockPool, KVCacheManager and EncoderCacheManager in isolation."""

from __future__ import annotations

import pytest

from pdcluster.engine.block_pool import BlockPool
from pdcluster.engine.config import CacheConfig
from pdcluster.engine.encoder_cache_manager import EncoderCacheManager
from pdcluster.engine.kv_cache_manager import KVCacheManager, hash_block_tokens
from tests.scheduler_utils import image, make_requests


def test_new_pool_is_all_free_and_idle_invariant():
    pool = BlockPool(8)
    assert pool.get_num_free_blocks() == pool.num_usable_blocks == 8
    assert pool.free_queue.block_ids() == list(range(8))


def test_get_new_blocks_then_free_in_reverse_puts_tail_first_in_line():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_num_free_blocks() == 3
    pool.free_blocks(reversed(blocks))
    assert pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    assert pool.get_num_free_blocks() == 6


def test_asking_for_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 2


def test_touch_removes_free_cached_block_from_queue_in_o1():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [11, 12])
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == 4
    hit = pool.get_cached_block(11)
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert 0 not in pool.free_queue.block_ids()
    assert pool.get_num_free_blocks() == 3
    pool.free_blocks([hit])
    assert pool.get_num_free_blocks() == 4


def test_lru_eviction_drops_hash_of_reused_block():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [1, 2])
    pool.free_blocks(reversed(blocks))  # queue: block 1 (hash 2), then block 0 (hash 1)
    (evicted,) = pool.get_new_blocks(1)
    assert evicted.block_id == 1 and evicted.block_hash is None
    assert pool.get_cached_block(2) is None
    assert pool.get_cached_block(1) is blocks[0]
    assert pool.num_evictions == 1


def test_forget_prefixes_uncaches_blocks_in_use_and_free():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [1, 2])
    pool.free_blocks([blocks[1]])  # one cached block free, one still referenced
    pool.forget_prefixes()
    assert pool.get_cached_block(1) is None and pool.get_cached_block(2) is None
    pool.free_blocks([blocks[0]])
    assert pool.get_num_free_blocks() == 4
    pool.get_new_blocks(4)
    assert pool.num_evictions == 0  # nothing cached was left to evict


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [5])
    pool.cache_full_blocks([b], [5])
    assert pool.get_cached_block(5) is a and b.block_hash is None


def test_double_free_raises():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])


def test_block_hash_depends_on_parent_tokens_and_extra_keys():
    base = hash_block_tokens(0, [1, 2, 3, 4])
    assert base == hash_block_tokens(0, [1, 2, 3, 4])
    assert base != hash_block_tokens(1, [1, 2, 3, 4])
    assert base != hash_block_tokens(0, [1, 2, 3, 5])
    assert base != hash_block_tokens(0, [1, 2, 3, 4], ("img-a",))
    assert hash_block_tokens(0, [1], ("img-a",)) != hash_block_tokens(0, [1], ("img-b",))


def test_kv_manager_allocate_free_and_prefix_hit():
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=10))
    (a,) = make_requests(1, 10)
    assert kv.get_computed_blocks(a) == ([], 0)
    assert len(kv.allocate_slots(a, 10)) == 3
    a.num_computed_tokens = 10
    kv.cache_blocks(a, 10)
    assert len(a.block_hashes) == 2
    b = make_requests(1, 10, id_prefix="b", prompt_token_ids=a.prompt_token_ids)[0]
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and [x.block_id for x in blocks] == kv.get_block_ids("req0")[:2]
    new = kv.allocate_slots(b, 2, num_hit, blocks)
    assert len(new) == 1 and blocks[0].ref_cnt == 2
    kv.free(a)
    kv.free(b)
    assert kv.get_num_free_blocks() == kv.num_blocks_total


def test_prefix_hit_never_covers_last_token():
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=10))
    (a,) = make_requests(1, 8)
    kv.allocate_slots(a, 8)
    kv.cache_blocks(a, 8)
    b = make_requests(1, prompt_token_ids=a.prompt_token_ids, id_prefix="b")[0]
    _, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4
    kv.free(a)


def test_allocate_returns_none_when_short_and_changes_nothing():
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=2))
    (a,) = make_requests(1, 12)
    assert kv.allocate_slots(a, 12) is None
    assert kv.get_num_free_blocks() == 2 and not kv.req_to_blocks


def test_image_hash_is_part_of_block_hash():
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=10))
    prompt = [5, 9, 9, 9, 9, 6, 7, 8, 3]
    (a,) = make_requests(1, prompt_token_ids=prompt, mm_features=[image("cat", 1, 4)])
    (b,) = make_requests(1, prompt_token_ids=prompt, mm_features=[image("dog", 1, 4)])
    kv.update_block_hashes(a, 8)
    kv.update_block_hashes(b, 8)
    assert a.block_hashes[0] != b.block_hashes[0]
    assert a.block_hashes[1] != b.block_hashes[1]  # the image ends in block 1, chain differs


def test_encoder_cache_reuse_and_lazy_eviction():
    cache = EncoderCacheManager(10)
    (a,) = make_requests(1, 20, mm_features=[image("x", 0, 6)])
    (b,) = make_requests(1, 20, mm_features=[image("x", 0, 6)], id_prefix="b")
    (c,) = make_requests(1, 20, mm_features=[image("y", 0, 6)], id_prefix="c")
    assert not cache.check_and_update_cache(a, 0)
    assert cache.can_allocate(a, 0, 100, 0)
    cache.allocate(a, 0)
    assert not cache.can_allocate(c, 0, 100, 0)  # x is referenced: no room for y
    cache.free(a)
    assert cache.num_referenced_entries() == 0
    assert cache.check_and_update_cache(b, 0)  # freeable entry reused, no compute
    cache.free(b)
    assert not cache.can_allocate(c, 0, 5, 0)  # over the compute budget
    assert cache.can_allocate(c, 0, 100, 0)  # evicts x
    assert cache.get_freed_mm_hashes() == ["x"]
    cache.allocate(c, 0)
    cache.free(c)
    assert cache.get_freed_mm_hashes() == []
    assert cache.num_free_slots == 4 and cache.num_freeable_slots == 10
