"""The KV block pool: reference counts, the free queue and the prefix-cache hash map.

`BlockPool` is the only owner of `ref_cnt`, the free queue and `block_hash`. Every block is
usable (no reserved null block), so an idle pool satisfies
`get_num_free_blocks() == num_usable_blocks`.

Invariants:
- a block is in the free queue iff its ref_cnt is 0;
- a block with a `block_hash` is the one block the hash map names for that hash;
- free blocks keep their hash (a later request may hit them) until they are handed out
  again, which evicts them: the queue head is the least recently freed block.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    """One physical KV block. `prev_free` / `next_free` link it into the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels: O(1) popleft, append and
    removal from the middle (a prefix-cache hit on a free block)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks, {self.num_free_blocks} free")
        out = []
        node = self._head.next_free
        for _ in range(n):
            out.append(node)
            nxt = node.next_free
            node.prev_free = node.next_free = None
            node = nxt
        self._head.next_free = node
        node.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        tail = self._tail
        last = tail.prev_free
        n = 0
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
            n += 1
        last.next_free = tail
        tail.prev_free = last
        self.num_free_blocks += n

    def block_ids(self) -> list[int]:
        """Head (next evicted) to tail; for tests and debugging."""
        out, node = [], self._head.next_free
        while node is not self._tail:
            out.append(node.block_id)
            node = node.next_free
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_usable_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[int, KVCacheBlock] = {}  # block hash -> full cached block
        self.num_evictions = 0
        # (stored, block hash) in the order the map changed, for routers that index what each
        # instance caches (like vLLM's KV events); None until `enable_kv_events`.
        self.kv_events: list[tuple[bool, int]] | None = None

    def enable_kv_events(self) -> None:
        """Record every hash the map gains or loses until `take_kv_events` drains them."""
        self.kv_events = []

    def take_kv_events(self) -> list[tuple[bool, int]]:
        events = self.kv_events or []
        if events:
            self.kv_events = []
        return events

    def get_num_free_blocks(self) -> int:
        """Blocks with no reference, cached or not: what `get_new_blocks` can hand out."""
        return self.free_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.free_queue.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """n blocks with ref_cnt 1, evicting the least recently freed cached ones.
        Check `get_num_free_blocks()` first: asking for more raises."""
        blocks = self.free_queue.popleft_n(n)
        cached = self.cached_blocks
        for block in blocks:
            if block.block_hash is not None:
                del cached[block.block_hash]
                self._record(False, block.block_hash)
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (prefix-cache hits)."""
        queue = self.free_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching 0 join the free queue's tail in
        the given order (so pass a request's blocks tail first: they are evicted first)."""
        released = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
            elif block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than referenced")
        self.free_queue.append_n(released)

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[int]) -> None:
        """Publish full blocks under their hashes. A hash that already names another block
        keeps that block; this one stays uncached (evicted without touching the map)."""
        if not self.enable_caching:
            return
        cached = self.cached_blocks
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None or block_hash in cached:
                continue
            block.block_hash = block_hash
            cached[block_hash] = block
            self._record(True, block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no block is referenced."""
        if self.free_queue.num_free_blocks != self.num_usable_blocks:
            return False
        self.forget_prefixes()
        return True

    def forget_prefixes(self) -> None:
        """Make every block unreachable by prefix lookups, referenced or not (after a failed
        step, whose blocks may hold partial KV): each is freed, later, as an uncached one."""
        for block in self.cached_blocks.values():
            self._record(False, block.block_hash)
            block.block_hash = None
        self.cached_blocks.clear()

    def _record(self, stored: bool, block_hash: int) -> None:
        if self.kv_events is not None:
            self.kv_events.append((stored, block_hash))
