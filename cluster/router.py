"""Routing policy: which E, P and D (or mixed) instance serves a request. No Ray here.

Loads are tracked from the router's own bookkeeping (what it sent and what finished), so a
decision costs no remote call. P is chosen by queued prefill tokens, preferring the instance
that already holds the longest prefix of the prompt in its cache; D by KV tokens held.
Short prompts, or prompts mostly cached on a D already, are prefilled on D itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

ROLE_ENCODER, ROLE_PREFILL, ROLE_DECODE, ROLE_MIXED = "encoder", "prefill", "decode", "mixed"


@dataclass(frozen=True)
class RouterConfig:
    block_size: int = 16
    max_model_len: int = 2048
    prefix_aware: bool = True
    # Prefer a P holding a prefix unless its queue is longer than the least loaded one's by
    # more than this many prefill tokens.
    prefix_slack_tokens: int = 2048
    # Prompts shorter than this are prefilled on D (0: always disaggregate).
    disagg_min_prompt_tokens: int = 0
    # Prefill on D when it already caches at least this fraction of the prompt (1.0: never).
    decode_prefix_fraction: float = 0.8
    max_tracked_blocks: int = 65536  # per instance, for prefix-aware routing
    # A request whose output stream nobody read for this long lost its client: abort it.
    stream_idle_timeout_s: float = 60.0


@dataclass
class InstanceLoad:
    instance_id: str
    role: str
    healthy: bool = True
    num_active: int = 0
    queued_prefill_tokens: int = 0
    kv_tokens: int = 0  # tokens whose KV the instance holds or will hold for running requests
    cached_blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)


@dataclass(frozen=True)
class Plan:
    """Where one request goes. `prefill_id is None` means the decode instance does it all."""

    encoder_id: str | None
    prefill_id: str | None
    decode_id: str

    @property
    def disaggregated(self) -> bool:
        return self.prefill_id is not None


def block_hashes(
    token_ids: list[int], block_size: int, images: Sequence[tuple[int, int, str]] = ()
) -> list[int]:
    """Chained hashes of the prompt's full blocks (a routing hint, not for KV reuse). A block
    overlapping an image's placeholders, given as (offset, end, mm_hash), includes its hash."""
    hashes, parent = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        extra = tuple(h for lo, hi, h in images if lo < end and start < hi)
        parent = hash((parent, extra, *token_ids[start:end]))
        hashes.append(parent)
    return hashes


class RouterPolicy:
    def __init__(self, roles: dict[str, str], config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self.instances = {iid: InstanceLoad(iid, role) for iid, role in roles.items()}

    # ---- health ----------------------------------------------------------------------
    def mark_dead(self, instance_id: str) -> None:
        load = self.instances[instance_id]
        load.healthy = False
        load.cached_blocks.clear()  # a restarted instance starts with an empty cache

    def mark_alive(self, instance_id: str) -> None:
        self.instances[instance_id].healthy = True

    def _live(self, role: str) -> list[InstanceLoad]:
        return [i for i in self.instances.values() if i.role == role and i.healthy]

    # ---- decisions -------------------------------------------------------------------
    def plan(
        self, prompt_token_ids: list[int], images: Sequence[tuple[int, int, str]] = ()
    ) -> Plan:
        """Pick instances for a prompt whose images are (offset, end, mm_hash) runs; raises
        RuntimeError when no live instance can serve."""
        hashes = block_hashes(prompt_token_ids, self.config.block_size, images)
        encoder = self._least(self._live(ROLE_ENCODER), "num_active") if images else None
        encoder_id = encoder.instance_id if encoder else None
        prefills, decodes = self._live(ROLE_PREFILL), self._live(ROLE_DECODE)
        if prefills and decodes:
            decode = self._least(decodes, "kv_tokens")
            if self._prefill_on_decode(prompt_token_ids, hashes, decode):
                return Plan(encoder_id, None, decode.instance_id)
            prefill = self._pick(prefills, hashes, "queued_prefill_tokens")
            return Plan(encoder_id, prefill.instance_id, decode.instance_id)
        # A role is missing: serve colocated, on mixed instances first.
        pool = self._live(ROLE_MIXED) or prefills or decodes
        if not pool:
            raise RuntimeError("no live instance can serve this request")
        return Plan(encoder_id, None, self._pick(pool, hashes, "kv_tokens").instance_id)

    def _prefill_on_decode(
        self, prompt: list[int], hashes: list[int], decode: InstanceLoad
    ) -> bool:
        if len(prompt) < self.config.disagg_min_prompt_tokens:
            return True
        if not hashes or self.config.decode_prefix_fraction >= 1.0:
            return False
        cached = self._num_cached_blocks(decode, hashes) * self.config.block_size
        return cached >= self.config.decode_prefix_fraction * len(prompt)

    def _pick(self, candidates: list[InstanceLoad], hashes: list[int], load: str) -> InstanceLoad:
        """The least loaded by `load`, or the one caching the longest prefix when its load
        is within `prefix_slack_tokens` of the least."""
        least = self._least(candidates, load)
        if not self.config.prefix_aware or not hashes:
            return least
        # Longest cached prefix; among equal prefixes, the least loaded.
        best = max(
            candidates, key=lambda i: (self._num_cached_blocks(i, hashes), -getattr(i, load))
        )
        slack = getattr(best, load) - getattr(least, load)
        if self._num_cached_blocks(best, hashes) > 0 and slack <= self.config.prefix_slack_tokens:
            return best
        return least

    @staticmethod
    def _least(candidates: list[InstanceLoad], attr: str) -> InstanceLoad | None:
        return min(candidates, key=lambda i: (getattr(i, attr), i.num_active), default=None)

    @staticmethod
    def _num_cached_blocks(load: InstanceLoad, hashes: list[int]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in load.cached_blocks:
            n += 1
        return n

    # ---- bookkeeping -----------------------------------------------------------------
    def on_prefill_start(
        self, instance_id: str, prompt_token_ids: list[int], images: Sequence = ()
    ) -> None:
        load = self.instances[instance_id]
        load.num_active += 1
        load.queued_prefill_tokens += len(prompt_token_ids)
        self._remember(load, prompt_token_ids, images)

    def on_encode_start(self, instance_id: str) -> None:
        self.instances[instance_id].num_active += 1

    def on_encode_end(self, instance_id: str) -> None:
        self.instances[instance_id].num_active -= 1

    def on_prefill_end(self, instance_id: str, num_prompt_tokens: int) -> None:
        load = self.instances[instance_id]
        load.num_active -= 1
        load.queued_prefill_tokens -= num_prompt_tokens

    def on_decode_start(
        self, instance_id: str, prompt_token_ids: list[int], max_tokens: int, images: Sequence = ()
    ) -> None:
        load = self.instances[instance_id]
        load.num_active += 1
        load.kv_tokens += len(prompt_token_ids) + max_tokens
        self._remember(load, prompt_token_ids, images)

    def on_decode_end(self, instance_id: str, num_tokens: int) -> None:
        load = self.instances[instance_id]
        load.num_active -= 1
        load.kv_tokens -= num_tokens

    def _remember(self, load: InstanceLoad, prompt: list[int], images: Sequence) -> None:
        # Leading blocks are touched last so they are evicted last: a prefix match needs
        # the chain from the first block.
        for h in reversed(block_hashes(prompt, self.config.block_size, images)):
            load.cached_blocks[h] = None
            load.cached_blocks.move_to_end(h)
        while len(load.cached_blocks) > self.config.max_tracked_blocks:
            load.cached_blocks.popitem(last=False)
