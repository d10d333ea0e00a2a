"""Routing policy: which E, P and D (or mixed) instance serves a request. No Ray here.

A decision costs no remote call. Each instance's load is the last one it published (for
every gateway replica's requests) plus what this replica sent or saw finish since then
(its own optimistic accounting). P is chosen by queued prefill tokens, preferring the
instance that caches the longest prefix of the prompt (known from the prefix-cache events
instances publish, and from what this replica sent them), a block in the cluster KV pool
(known from the pool's own events) counting for less than one the instance holds and more
than none, since any instance loads it instead of computing it; D by KV tokens held. Short
prompts, or prompts mostly cached on a D already, are prefilled on D itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pdcluster.engine.kv_cache_manager import NONE_HASH, hash_block_tokens
from pdcluster.routing.role import Role

DEFAULT_MIGRATION_LIMIT = 3  # moves of one request to other instances after losing its own
# What a prefix block in the cluster KV pool is worth to an instance that lacks it, against
# one it caches (1) and one it must compute (0): loading costs a copy, not a forward pass.
POOL_BLOCK_WEIGHT = 0.5


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
    # A request whose instance is lost moves to others at most this often, then fails.
    migration_limit: int = DEFAULT_MIGRATION_LIMIT


@dataclass
class Load:
    """The figures a routing decision balances on."""

    num_active: int = 0
    queued_prefill_tokens: int = 0
    kv_tokens: int = 0  # tokens whose KV the instance holds or will hold for running requests


LOAD_FIELDS = ("num_active", "queued_prefill_tokens", "kv_tokens")


@dataclass
class InstanceLoad:
    instance_id: str
    role: Role
    healthy: bool = True
    late: bool = False  # its last pull went unanswered long: new requests go elsewhere first
    own: Load = field(default_factory=Load)  # this replica's requests in flight there
    published: Load | None = None  # the instance's last report (every replica's requests)
    own_at_publish: Load = field(default_factory=Load)  # `own` when that report came
    cached_blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)
    num_blocks_total: int | None = None  # its KV pool, as last reported
    # LoRA adapters resident in its layers, as last reported (and those sent there since)
    adapters: set[str] = field(default_factory=set)

    def load(self, name: str) -> int:
        """Published load plus what this replica changed since; its own alone before any
        report."""
        own = getattr(self.own, name)
        if self.published is None:
            return own
        return max(0, getattr(self.published, name) + own - getattr(self.own_at_publish, name))

    @property
    def num_active(self) -> int:
        return self.load("num_active")

    @property
    def queued_prefill_tokens(self) -> int:
        return self.load("queued_prefill_tokens")

    @property
    def kv_tokens(self) -> int:
        return self.load("kv_tokens")


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
    token_ids: list[int],
    block_size: int,
    images: Sequence[tuple[int, int, str]] = (),
    root: int = NONE_HASH,
) -> list[int]:
    """Chained hashes of the prompt's full blocks, equal to the engine's prefix-cache hashes
    (so instances' cache events name them). A block overlapping an image's placeholders,
    given as (offset, end, mm_hash), includes its hash; the chain starts from `root`, the
    request's salt and adapter (`kv_cache_manager.request_root`), so a salted or adapted chain
    matches only blocks cached under the same salt and adapter."""
    hashes, parent = [], root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        extra = tuple(h for lo, hi, h in images if lo < end and start < hi)
        parent = hash_block_tokens(parent, token_ids[start:end], extra)
        hashes.append(parent)
    return hashes


class RouterPolicy:
    def __init__(self, roles: dict[str, Role], config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self.instances = {iid: InstanceLoad(iid, role) for iid, role in roles.items()}
        # Block hashes the cluster KV pool holds: a tier every P and mixed instance loads from.
        self.pool_blocks: OrderedDict[int, None] = OrderedDict()

    # ---- membership and health ---------------------------------------------------------
    def add_instance(self, instance_id: str, role: Role) -> None:
        if instance_id not in self.instances:
            self.instances[instance_id] = InstanceLoad(instance_id, role)

    def min_kv_tokens(self, roles: Iterable[Role]) -> int | None:
        """The KV tokens of the smallest reported pool among healthy instances of `roles`;
        None before any of them reported."""
        sizes = [
            load.num_blocks_total * self.config.block_size
            for load in list(self.instances.values())  # read from the gateway's thread too
            if load.role in roles and load.healthy and load.num_blocks_total is not None
        ]
        return min(sizes, default=None)

    def remove_instance(self, instance_id: str) -> None:
        self.instances.pop(instance_id, None)

    def mark_dead(self, instance_id: str) -> None:
        load = self.instances[instance_id]
        load.healthy = False
        load.cached_blocks.clear()  # a restarted instance starts with an empty cache

    def mark_alive(self, instance_id: str) -> None:
        load = self.instances[instance_id]
        load.healthy, load.late = True, False

    def mark_late(self, instance_id: str) -> None:
        """It is slow to answer (a loaded host, a long step), not dead: new requests go to
        instances that answer in time while there are any, and to it when there are none."""
        self.instances[instance_id].late = True

    def apply_report(
        self,
        instance_id: str,
        published: Load,
        num_blocks_total: int | None = None,
        adapters: Iterable[str] = (),
    ) -> None:
        """The instance's own count of its load (and size of its KV pool, and the LoRA
        adapters resident there), as of now."""
        load = self.instances.get(instance_id)
        if load is not None:
            load.published = published
            load.num_blocks_total = num_blocks_total
            load.adapters = set(adapters)
            load.own_at_publish = Load(**{f: getattr(load.own, f) for f in LOAD_FIELDS})

    def apply_kv_events(
        self, instance_id: str, stored: Iterable[int], removed: Iterable[int], reset: bool
    ) -> None:
        """Prefix-cache changes the instance published; `reset`: `stored` is all it caches."""
        load = self.instances.get(instance_id)
        if load is None:
            return
        if reset:
            load.cached_blocks.clear()
        for h in removed:
            load.cached_blocks.pop(h, None)
        for h in stored:
            load.cached_blocks[h] = None
        self._bound(load)

    def apply_pool_events(self, stored: Iterable[int], removed: Iterable[int], reset: bool) -> None:
        """Blocks the cluster KV pool gained and lost; `reset`: `stored` is all it holds."""
        if reset:
            self.pool_blocks.clear()
        for h in removed:
            self.pool_blocks.pop(h, None)
        for h in stored:
            self.pool_blocks[h] = None
        while len(self.pool_blocks) > self.config.max_tracked_blocks:
            self.pool_blocks.popitem(last=False)

    def _live(self, role: Role) -> list[InstanceLoad]:
        """The healthy instances of `role`: those answering in time, else the late ones."""
        live = [i for i in self.instances.values() if i.role == role and i.healthy]
        return [i for i in live if not i.late] or live

    # ---- decisions -------------------------------------------------------------------
    def plan(
        self,
        prompt_token_ids: list[int],
        images: Sequence[tuple[int, int, str]] = (),
        root: int = NONE_HASH,
        lora_name: str | None = None,
    ) -> Plan:
        """Pick instances for a prompt whose images are (offset, end, mm_hash) runs (and whose
        blocks chain from `root`; `lora_name`: the LoRA adapter it runs under); raises
        RuntimeError when no live instance can serve."""
        hashes = block_hashes(prompt_token_ids, self.config.block_size, images, root)
        encoder = self._least(self._live(Role.ENCODER), "num_active") if images else None
        encoder_id = encoder.instance_id if encoder else None
        prefills, decodes = self._live(Role.PREFILL), self._live(Role.DECODE)
        if prefills and decodes:
            decode = self._least(self._holding(decodes, lora_name, "kv_tokens"), "kv_tokens")
            if self._prefill_on_decode(prompt_token_ids, hashes, decode):
                return self._planned(Plan(encoder_id, None, decode.instance_id), lora_name)
            prefills = self._holding(prefills, lora_name, "queued_prefill_tokens")
            prefill = self._pick(prefills, hashes, "queued_prefill_tokens")
            plan = Plan(encoder_id, prefill.instance_id, decode.instance_id)
            return self._planned(plan, lora_name)
        # A role is missing: serve colocated, on mixed instances first.
        pool = self._live(Role.MIXED) or prefills or decodes
        if not pool:
            raise RuntimeError("no live instance can serve this request")
        pool = self._holding(pool, lora_name, "kv_tokens")
        return self._planned(
            Plan(encoder_id, None, self._pick(pool, hashes, "kv_tokens").instance_id), lora_name
        )

    def _holding(
        self, candidates: list[InstanceLoad], lora_name: str | None, load: str
    ) -> list[InstanceLoad]:
        """The candidates that hold the adapter `lora_name` (it runs there without a load)
        when the least loaded of them is within `prefix_slack_tokens` of the least loaded of
        all; else all of them."""
        holders = [c for c in candidates if lora_name in c.adapters]
        if lora_name is None or not holders:
            return candidates
        slack = self._least(holders, load).load(load) - self._least(candidates, load).load(load)
        return holders if slack <= self.config.prefix_slack_tokens else candidates

    def _planned(self, plan: Plan, lora_name: str | None) -> Plan:
        """`plan`, its instances noted as holding `lora_name` from now on."""
        if lora_name is not None:
            for iid in (plan.prefill_id, plan.decode_id):
                if iid is not None:
                    self.instances[iid].adapters.add(lora_name)
        return plan

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
        is within the slack of the least: `prefix_slack_tokens` times the share of its
        cached blocks that the least would have to compute (blocks the least loads from the
        cluster KV pool count POOL_BLOCK_WEIGHT as held), so a prefix any instance can load
        draws requests less than one only this instance holds."""
        least = self._least(candidates, load)
        if not self.config.prefix_aware or not hashes:
            return least
        num_pooled = self._num_pooled_blocks(hashes)

        def score(i: InstanceLoad) -> float:  # own blocks 1, the pool's beyond them less
            num_own = self._num_cached_blocks(i, hashes)
            return num_own + POOL_BLOCK_WEIGHT * max(0, num_pooled - num_own)

        best = max(candidates, key=lambda i: (score(i), -i.load(load)))
        num_own = self._num_cached_blocks(best, hashes)
        if num_own == 0:
            return least
        share = (score(best) - score(least)) / num_own
        slack = best.load(load) - least.load(load)
        return best if share > 0 and slack <= self.config.prefix_slack_tokens * share else least

    @staticmethod
    def _least(candidates: list[InstanceLoad], attr: str) -> InstanceLoad | None:
        return min(candidates, key=lambda i: (i.load(attr), i.num_active), default=None)

    @staticmethod
    def _num_cached_blocks(load: InstanceLoad, hashes: list[int]) -> int:
        return _leading(hashes, load.cached_blocks)

    def _num_pooled_blocks(self, hashes: list[int]) -> int:
        return _leading(hashes, self.pool_blocks)

    # ---- bookkeeping -----------------------------------------------------------------
    def on_prefill_start(
        self,
        instance_id: str,
        prompt_token_ids: list[int],
        images: Sequence = (),
        root: int = NONE_HASH,
    ) -> None:
        load = self.instances[instance_id]
        load.own.num_active += 1
        load.own.queued_prefill_tokens += len(prompt_token_ids)
        self._remember(load, prompt_token_ids, images, root)

    def on_encode_start(self, instance_id: str) -> None:
        self.instances[instance_id].own.num_active += 1

    def on_encode_end(self, instance_id: str) -> None:
        self._own(instance_id).num_active -= 1

    def on_prefill_end(self, instance_id: str, num_prompt_tokens: int) -> None:
        own = self._own(instance_id)
        own.num_active -= 1
        own.queued_prefill_tokens -= num_prompt_tokens

    def on_decode_start(
        self,
        instance_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        images: Sequence = (),
        cached: bool = True,
        root: int = NONE_HASH,
    ) -> None:
        """The request's KV is spoken for on the instance; with `cached`, its prompt is (or
        is about to be) there too. A D planned for a request still on its P is not yet
        told of that prompt: see `on_prompt_cached`."""
        load = self.instances[instance_id]
        load.own.num_active += 1
        load.own.kv_tokens += len(prompt_token_ids) + max_tokens
        if cached:
            self._remember(load, prompt_token_ids, images, root)

    def on_prompt_cached(
        self,
        instance_id: str,
        prompt_token_ids: list[int],
        images: Sequence = (),
        root: int = NONE_HASH,
    ) -> None:
        load = self.instances.get(instance_id)
        if load is not None:
            self._remember(load, prompt_token_ids, images, root)

    def on_decode_end(self, instance_id: str, num_tokens: int) -> None:
        own = self._own(instance_id)
        own.num_active -= 1
        own.kv_tokens -= num_tokens

    def _own(self, instance_id: str) -> Load:
        """This replica's accounting of an instance; a removed one's is dropped with it."""
        load = self.instances.get(instance_id)
        return load.own if load is not None else Load()

    def _remember(self, load: InstanceLoad, prompt: list[int], images: Sequence, root: int) -> None:
        # Leading blocks are touched last so they are evicted last: a prefix match needs
        # the chain from the first block.
        for h in reversed(block_hashes(prompt, self.config.block_size, images, root)):
            load.cached_blocks[h] = None
            load.cached_blocks.move_to_end(h)
        self._bound(load)

    def _bound(self, load: InstanceLoad) -> None:
        while len(load.cached_blocks) > self.config.max_tracked_blocks:
            load.cached_blocks.popitem(last=False)


def _leading(hashes: list[int], held: OrderedDict[int, None]) -> int:
    """How many of `hashes`, from the first, `held` holds."""
    n = 0
    while n < len(hashes) and hashes[n] in held:
        n += 1
    return n
