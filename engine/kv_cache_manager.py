"""Per-request KV block tables and prefix caching over one `BlockPool`.

A full block's hash chains its parent's hash, its token ids and its extra keys (the mm_hash of
every image whose placeholder run overlaps the block), so equal token ids with a different
image never hit. A request's `cache_salt` and LoRA adapter replace the first block's parent
(`root_hash`), so every hash of a salted chain differs from the unsalted one and from every other
salt's: requests with different salts never share a block, while equal salts share as unsalted
requests do; likewise each adapter's blocks (named by its name and folder) are its own.
Hashes are 128-bit BLAKE2b digests, so a crafted prompt cannot collide with
another user's prefix. They are computed once per block, as blocks fill, and kept in
`Request.block_hashes` (they survive preemption: token ids never change).

A block is published to the prefix cache (`cache_blocks`) as soon as the scheduler schedules
the tokens that fill it, so a request admitted later in the same step hits it: that step's
forward pass writes its KV before reading any (see `engine.scheduler`). Only full blocks are
published, each under the hash of its known token ids.
"""

from __future__ import annotations

from array import array
from hashlib import blake2b

from pdcluster.engine.block_pool import BlockPool, KVCacheBlock
from pdcluster.engine.config import CacheConfig
from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.engine.request import Request

NONE_HASH = 0  # parent hash of an unsalted request's first block
_SALT_DOMAIN = b"pdcluster.cache_salt\x00"  # a salted root is never a token block's digest
_LORA_DOMAIN = b"pdcluster.lora\x00"  # nor an adapter's root a salt's


def root_hash(cache_salt: str | None, lora: LoRARequest | None = None) -> int:
    """The parent hash of the first block of a request with this salt and adapter."""
    if lora is not None:  # each part after its length: no two triples read the same
        h = blake2b(_LORA_DOMAIN, digest_size=16)
        for part in (cache_salt or "", lora.name, lora.path):
            data = part.encode()
            h.update(len(data).to_bytes(8, "little") + data)
        return int.from_bytes(h.digest(), "little")
    if not cache_salt:
        return NONE_HASH
    h = blake2b(_SALT_DOMAIN, digest_size=16)
    h.update(cache_salt.encode())
    return int.from_bytes(h.digest(), "little")


def request_root(request: Request) -> int:
    """`root_hash` of the request's salt and adapter."""
    return root_hash(request.cache_salt, request.lora_request)


def hash_block_tokens(parent_hash: int, token_ids: list[int], extra_keys: tuple = ()) -> int:
    h = blake2b(parent_hash.to_bytes(16, "little"), digest_size=16)
    h.update(array("q", token_ids))
    for key in extra_keys:
        h.update(b"\x00")
        h.update(str(key).encode())
    return int.from_bytes(h.digest(), "little")


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    """request.all_token_ids[start:end] without building the whole list."""
    prompt = request.prompt_token_ids
    num_prompt = len(prompt)
    if end <= num_prompt:
        return prompt[start:end]
    outputs = request.output_token_ids
    if start >= num_prompt:
        return outputs[start - num_prompt : end - num_prompt]
    return prompt[start:] + outputs[: end - num_prompt]


def _mm_extra_keys(request: Request, start: int, end: int) -> tuple:
    return tuple(f.mm_hash for f in request.mm_features if f.offset < end and f.end > start)


class KVCacheManager:
    def __init__(self, cache_config: CacheConfig, enable_caching: bool = True) -> None:
        self.block_size = cache_config.block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(cache_config.num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks already published
        self.num_prefix_queries = 0  # tokens looked up
        self.num_prefix_hits = 0  # tokens found

    # ---- stats ------------------------------------------------------------------------
    @property
    def num_blocks_total(self) -> int:
        return self.block_pool.num_usable_blocks

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    # ---- hashing ----------------------------------------------------------------------
    def update_block_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Extend request.block_hashes to cover every full block in the first num_tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        num_full = num_tokens // bs
        if len(hashes) >= num_full:
            return hashes
        parent = hashes[-1] if hashes else request_root(request)
        has_mm = bool(request.mm_features)
        for i in range(len(hashes), num_full):
            start, end = i * bs, (i + 1) * bs
            extra = _mm_extra_keys(request, start, end) if has_mm else ()
            parent = hash_block_tokens(parent, _token_slice(request, start, end), extra)
            hashes.append(parent)
        return hashes

    # ---- prefix cache -----------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks, never covering the last token (its
        logits must be computed). Takes no reference: pass the blocks to allocate_slots."""
        if not self.enable_caching:
            return [], 0
        num_tokens = request.num_tokens
        max_hit_blocks = (num_tokens - 1) // self.block_size
        hashes = self.update_block_hashes(request, num_tokens)
        lookup = self.block_pool.cached_blocks.get
        blocks = []
        for block_hash in hashes[:max_hit_blocks]:
            block = lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_hit = len(blocks) * self.block_size
        self.num_prefix_queries += num_tokens
        self.num_prefix_hits += num_hit
        return blocks, num_hit

    # ---- allocation -------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_external_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens (plus prefix hits and externally loaded tokens) after
        request.num_computed_tokens. Returns the newly allocated blocks, or None (and changes
        nothing) when the pool is short."""
        num_needed_tokens = (
            request.num_computed_tokens
            + num_new_computed_tokens
            + num_new_tokens
            + num_external_tokens
        )
        num_required = -(-num_needed_tokens // self.block_size)
        req_blocks = self.req_to_blocks.get(request.request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
            self.num_cached_blocks[request.request_id] = 0
        if not new_computed_blocks:
            if num_required <= len(req_blocks):  # decode fast path
                return []
            new_computed_blocks = ()
        num_new = num_required - len(req_blocks) - len(new_computed_blocks)
        pool = self.block_pool
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new > pool.get_num_free_blocks() - num_free_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
                del self.num_cached_blocks[request.request_id]
            return None
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(req_blocks)
        new_blocks = pool.get_new_blocks(num_new) if num_new > 0 else []
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's blocks that the first num_computed_tokens fill (or fill in
        the step being scheduled)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = min(num_computed_tokens, request.num_tokens) // self.block_size
        num_cached = self.num_cached_blocks.get(rid)
        if num_cached is None or num_full <= num_cached:
            return
        hashes = self.update_block_hashes(request, num_full * self.block_size)
        blocks = self.req_to_blocks[rid]
        self.block_pool.cache_full_blocks(blocks[num_cached:num_full], hashes[num_cached:num_full])
        self.num_cached_blocks[rid] = num_full

    def trim(self, request: Request, num_tokens: int) -> int:
        """Release the request's blocks past those its first num_tokens need (the slots of
        rejected draft tokens), tail first; returns how many. None of them is published."""
        blocks = self.req_to_blocks.get(request.request_id)
        num_kept = -(-num_tokens // self.block_size)
        if not blocks or len(blocks) <= num_kept:
            return 0
        dropped = blocks[num_kept:]
        del blocks[num_kept:]
        self.block_pool.free_blocks(reversed(dropped))
        return len(dropped)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
