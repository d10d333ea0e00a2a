"""Connector interfaces the engine calls. No Ray here: implementations live beside this file.

One object serves both sides of an instance: the scheduler side (called from `Scheduler`)
decides what to load, save and free; the worker side (called from `EngineCore` around the
model run) moves the bytes. The names mirror vLLM v1's KV and EC connectors.
"""

from __future__ import annotations

import dataclasses
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pdcluster.connectors.stats import ECStats, KVConnectorStats

if TYPE_CHECKING:
    import torch

    from pdcluster.engine.outputs import SchedulerOutput
    from pdcluster.engine.request import Request


def new_epoch() -> str:
    """A name for one incarnation of an actor (an instance, the KV pool, a pool controller):
    a restart under the same actor name gets a new one, so that what was addressed to its
    predecessor (an ack, a release, a cursor) is told apart."""
    return uuid.uuid4().hex[:12]


class HeadShardedKV(Protocol):
    """The KV pool of a tensor-parallel instance, whose ranks each hold some KV heads: blocks
    read and written whole, with every rank's heads (the layout of an unsharded pool)."""

    @property
    def block_shape(self) -> tuple[int, ...]:
        """[num_layers, 2, block_size, num_kv_heads, head_dim] of one whole block."""

    def read_blocks(self, start: int, count: int) -> torch.Tensor:
        """Blocks [start, start + count): [count, *block_shape]."""

    def write_blocks(self, start: int, blocks: torch.Tensor) -> None:
        """Store `blocks` [count, *block_shape] from block `start` on."""


class KVHandle:
    """What a consumer needs to read the KV one producer published. Each connector
    subclasses it with a frozen dataclass of its own; the handle travels inside
    `KVTransferParams` across Ray as it is (never as a dict)."""

    def released(self) -> KVHandle:
        """A copy that no longer references the published data (once a load holds it)."""
        return self


class KVLoadError(Exception):
    """Why a remote KV load cannot start or did not land (the request's load fails)."""


@dataclass(frozen=True)
class KVTransferParams:
    """The P->D handoff message, from the router to P's connector, back out of P's scheduler
    and on to D's connector, as this one type. Its public dict form (vLLM's
    `kv_transfer_params`) exists only where JSON enters or leaves the process:
    `from_dict` / `to_dict`."""

    do_remote_decode: bool = False  # set on the request sent to P
    do_remote_prefill: bool = False  # set on the request sent to D
    remote_engine_id: str | None = None  # P's engine id
    remote_request_id: str | None = None  # the request id on P
    num_tokens: int = 0  # tokens whose KV P computed (the prompt)
    handle: KVHandle | None = None  # what D needs to read the KV (connector-specific)

    @classmethod
    def remote_decode(cls) -> KVTransferParams:
        """What a request sent to P carries: compute the prompt, keep its KV for a D."""
        return cls(do_remote_decode=True)

    def released(self) -> KVTransferParams:
        """These params with a handle that no longer references the published data."""
        if self.handle is None:
            return self
        return dataclasses.replace(self, handle=self.handle.released())

    def to_dict(self) -> dict[str, object]:
        """The public form (vLLM's `kv_transfer_params`); the handle stays an object."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, params: Mapping[str, object]) -> KVTransferParams:
        """The public form, checked: ValueError names an unknown key or a wrong type."""
        unknown = set(params) - _PARAM_TYPES.keys()
        if unknown:
            raise ValueError(f"unknown kv_transfer_params keys: {sorted(unknown)}")
        for key, value in params.items():
            kinds = _PARAM_TYPES[key]
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                names = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
                raise ValueError(f"kv_transfer_params[{key!r}] must be {names}, got {value!r}")
        return cls(**params)  # type: ignore[arg-type]

    @classmethod
    def of(cls, params: KVTransferParams | Mapping[str, object] | None) -> KVTransferParams | None:
        """The typed params of `params` as a caller gave them (typed, public dict, or none)."""
        if params is None or isinstance(params, KVTransferParams):
            return params
        return cls.from_dict(params)


_PARAM_TYPES: dict[str, tuple[type, ...]] = {
    "do_remote_decode": (bool,),
    "do_remote_prefill": (bool,),
    "remote_engine_id": (str, type(None)),
    "remote_request_id": (str, type(None)),
    "num_tokens": (int,),
    "handle": (KVHandle, type(None)),
}


class KVConnectorBase(ABC):
    """Moves KV blocks between a producer (prefill) and a consumer (decode) instance."""

    # ---- scheduler side -------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` whose KV can be loaded from a remote instance,
        and whether the load is asynchronous. `None` means: not known yet, ask next step."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Called after blocks were allocated for a request that will load external KV."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """What the worker side needs this step (loads to start, saves to make)."""

    @abstractmethod
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        """Returns (delay_free, kv_transfer_params). With delay_free the scheduler keeps the
        blocks until the request id is reported in `finished_sending`."""

    # ---- worker side ----------------------------------------------------------------
    def register_kv_caches(  # noqa: B027
        self, kv_caches: torch.Tensor, draft_kv_cache: torch.Tensor | None = None
    ) -> None:
        """The instance's KV pool, [num_blocks, num_layers, 2, block_size, kv_heads, head_dim],
        and its draft model's, in the same blocks (speculative method draft_model)."""

    def take_loaded_draft_tokens(self, request_id: str) -> int:
        """Tokens of `request_id` whose draft-model KV was loaded with the target's (asked
        once, when the request is first scheduled after its load); 0 when none was."""
        return 0

    def register_head_shards(self, shards: HeadShardedKV) -> None:
        """A tensor-parallel instance's whole-block view of its pool (after
        `register_kv_caches`, which then holds rank 0's heads only)."""
        raise ValueError(f"{type(self).__name__} cannot move a tensor-parallel instance's KV")

    def set_modeled_transfer(self, transfer_s: Callable[[int], float]) -> None:  # noqa: B027
        """A simulated model's link: a load of n tokens is reported finished no earlier than
        `transfer_s(n)` seconds after it started (the data itself still moves for real)."""

    @abstractmethod
    def start_load_kv(self, metadata: Any) -> None:
        """Start the loads named in `metadata`; must not block the step loop."""

    def save_kv(self, metadata: Any) -> None:  # noqa: B027
        """Publish KV named in `metadata` for remote readers."""

    def wait_for_save(self) -> None:  # noqa: B027
        """Block until saves started by `save_kv` are visible to readers."""

    @abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) since the last call."""

    def has_pending(self) -> bool:
        """Work left with no request in the scheduler (e.g. a send cancelled by an abort that
        still holds its object): the instance keeps stepping while this is True."""
        return False

    def needs_polling(self) -> bool:
        """Pending work the instance must keep stepping to notice. Sends that only await
        their reader's ack do not count: the ack arrives as a call that wakes the instance,
        and leases can be checked at leisure."""
        return self.has_pending()

    def cancel_sends(self, request_ids: list[str]) -> None:  # noqa: B027
        """Producer: these requests were aborted; stop holding their KV for a reader."""

    def get_failed_loads(self) -> set[str]:
        """Requests whose load failed since the last call (policy decides what follows)."""
        return set()

    def load_failure_recomputes(self, request: Request) -> bool:
        """Whether this request's failed load is recomputed whatever `kv_load_failure_policy`
        says: True for a cache's load (the KV pool's), False for a prefill's handoff."""
        return False

    def stats(self) -> KVConnectorStats:
        """This connector's counters (none reported by default)."""
        return KVConnectorStats()

    def shutdown(self) -> None:  # noqa: B027
        """Release everything this connector holds."""


class ECConnectorBase(ABC):
    """Moves encoder outputs (embeddings of one image, keyed by its content hash)."""

    # ---- scheduler side -------------------------------------------------------------
    @abstractmethod
    def has_cache_item(self, mm_hash: str) -> bool:
        """True when this encoder output can be loaded instead of computed."""

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """False defers the request this step. Must not block. Only features ending after
        `num_computed_tokens` (offset + length > num_computed_tokens) are of concern."""
        return True

    def awaits_outputs(self, request_id: str) -> bool:
        """Whether the request waits for encoder outputs still in flight (their arrival
        wakes the instance, so it need not poll meanwhile)."""
        return False

    def update_state_after_alloc(self, request: Request, index: int) -> None:  # noqa: B027
        """Feature `index` of `request` was given encoder-cache space and will be loaded."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """What the worker side loads this step."""

    # ---- worker side ----------------------------------------------------------------
    @abstractmethod
    def start_load_caches(self, metadata: Any, encoder_cache: dict[str, torch.Tensor]) -> None:
        """Put the encoder outputs named in `metadata` into `encoder_cache` (by mm_hash)."""

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:  # noqa: B027
        """Publish one freshly computed encoder output (producer side)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) since the last call."""
        return set(), set()

    def stats(self) -> ECStats:
        """This connector's counters as a consumer (zero where it loads nothing)."""
        return ECStats()

    def shutdown(self) -> None:  # noqa: B027
        """Release everything this connector holds."""
