"""Encoder-output cache accounting, in embeddings, keyed by an image's content hash.

An entry is referenced by every request that still needs its embeddings. An entry with no
reference stays cached ("freeable") so a later request with the same image reuses it with no
encoder run; it is evicted, least recently released first, only when space is needed, and its
mm_hash is then reported by `get_freed_mm_hashes()` so the runner drops the tensor.

Invariant: num_free_slots = cache_size - sum(sizes of all entries);
num_freeable_slots = num_free_slots + sum(sizes of unreferenced entries).
"""

from __future__ import annotations

from collections import OrderedDict

from pdcluster.engine.request import Request


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.num_freeable_slots = cache_size
        self.cached: dict[str, set[str]] = {}  # mm_hash -> ids of requests referencing it
        self.entry_sizes: dict[str, int] = {}  # mm_hash -> embeddings
        self.freeable: OrderedDict[str, int] = OrderedDict()  # unreferenced, oldest first
        self.freed: list[str] = []  # evicted since the last get_freed_mm_hashes()

    def check_and_update_cache(self, request: Request, index: int) -> bool:
        """True when feature `index` is cached; the request then references it."""
        mm_hash = request.mm_features[index].mm_hash
        refs = self.cached.get(mm_hash)
        if refs is None:
            return False
        if not refs:
            self.num_freeable_slots -= self.freeable.pop(mm_hash)
        refs.add(request.request_id)
        return True

    def is_cached(self, mm_hash: str) -> bool:
        return mm_hash in self.cached

    def can_allocate(
        self,
        request: Request,
        index: int,
        encoder_compute_budget: int | float,
        num_embeds_to_schedule: int,
    ) -> bool:
        """Whether feature `index` fits the compute budget and, next to the
        num_embeds_to_schedule already planned this step, the cache. Evicts unreferenced
        entries (oldest first) to make room when that makes it fit."""
        num_embeds = request.mm_features[index].length
        if num_embeds > encoder_compute_budget:
            return False
        needed = num_embeds + num_embeds_to_schedule
        if needed <= self.num_free_slots:
            return True
        if needed > self.num_freeable_slots:
            return False
        while self.num_free_slots < needed:
            mm_hash, size = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            del self.entry_sizes[mm_hash]
            self.freed.append(mm_hash)
            self.num_free_slots += size
        return True

    def allocate(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        refs = self.cached.get(feature.mm_hash)
        if refs is not None:  # planned twice in one step (same image twice)
            self.check_and_update_cache(request, index)
            return
        self.cached[feature.mm_hash] = {request.request_id}
        self.entry_sizes[feature.mm_hash] = feature.length
        self.num_free_slots -= feature.length
        self.num_freeable_slots -= feature.length

    def get_cached_input_ids(self, request: Request) -> list[int]:
        """Indices of the request's features it currently references."""
        rid = request.request_id
        cached = self.cached
        return [i for i, f in enumerate(request.mm_features) if rid in cached.get(f.mm_hash, ())]

    def free_encoder_input(self, request: Request, index: int) -> None:
        mm_hash = request.mm_features[index].mm_hash
        refs = self.cached.get(mm_hash)
        if not refs or request.request_id not in refs:
            return
        refs.discard(request.request_id)
        if not refs:
            size = self.entry_sizes[mm_hash]
            self.freeable[mm_hash] = size
            self.num_freeable_slots += size

    def free(self, request: Request) -> None:
        for index in self.get_cached_input_ids(request):
            self.free_encoder_input(request, index)

    def get_freed_mm_hashes(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    def num_referenced_entries(self) -> int:
        return sum(1 for refs in self.cached.values() if refs)
