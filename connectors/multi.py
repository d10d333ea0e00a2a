"""Several KV connectors behind the one the scheduler talks to (vLLM's MultiConnector): P
and D hand off through one and share prefixes through the cluster KV pool with another.

A request's external tokens come from the first connector that reports any (or that does
not know yet): that one is told about the allocation, the others are told of none. Finished
requests go to every connector; their blocks are held while any delays the free. No Ray here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from pdcluster.connectors.base import HeadShardedKV, KVConnectorBase, KVTransferParams
from pdcluster.connectors.stats import KVConnectorStats
from pdcluster.engine.request import Request

C = TypeVar("C", bound=KVConnectorBase)


class MultiKVConnector(KVConnectorBase):
    def __init__(self, connectors: list[KVConnectorBase]) -> None:
        if not connectors:
            raise ValueError("MultiKVConnector needs at least one connector")
        self.connectors = list(connectors)
        self._claims: dict[str, int] = {}  # request id -> index of the connector loading it

    def find(self, cls: type[C]) -> C | None:
        """The member of type `cls`, or None."""
        return next((c for c in self.connectors if isinstance(c, cls)), None)

    # ---- scheduler side -------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        for i, connector in enumerate(self.connectors):
            num_external, load_async = connector.get_num_new_matched_tokens(
                request, num_computed_tokens
            )
            if num_external is None or num_external > 0:
                self._claims[request.request_id] = i
                return num_external, load_async
        self._claims.pop(request.request_id, None)
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        claim = self._claims.pop(request.request_id, None)
        for i, connector in enumerate(self.connectors):
            num = num_external_tokens if i == claim else 0
            connector.update_state_after_alloc(request, block_ids, num)

    def build_connector_meta(self, scheduler_output: Any) -> tuple[Any, ...]:
        return tuple(c.build_connector_meta(scheduler_output) for c in self.connectors)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        self._claims.pop(request.request_id, None)
        delay_free, params = False, None
        for connector in self.connectors:
            delay, out = connector.request_finished(request, block_ids)
            delay_free = delay_free or delay
            params = params if params is not None else out
        return delay_free, params

    # ---- worker side ----------------------------------------------------------------
    def register_kv_caches(
        self, kv_caches: torch.Tensor, draft_kv_cache: torch.Tensor | None = None
    ) -> None:
        for connector in self.connectors:
            connector.register_kv_caches(kv_caches, draft_kv_cache)

    def take_loaded_draft_tokens(self, request_id: str) -> int:
        return max(c.take_loaded_draft_tokens(request_id) for c in self.connectors)

    def register_head_shards(self, shards: HeadShardedKV) -> None:
        for connector in self.connectors:
            connector.register_head_shards(shards)

    def set_modeled_transfer(self, transfer_s: Callable[[int], float]) -> None:
        for connector in self.connectors:
            connector.set_modeled_transfer(transfer_s)

    def start_load_kv(self, metadata: Any) -> None:
        for connector, meta in zip(self.connectors, self._metas(metadata), strict=True):
            connector.start_load_kv(meta)

    def save_kv(self, metadata: Any) -> None:
        for connector, meta in zip(self.connectors, self._metas(metadata), strict=True):
            connector.save_kv(meta)

    def wait_for_save(self) -> None:
        for connector in self.connectors:
            connector.wait_for_save()

    def _metas(self, metadata: Any) -> tuple[Any, ...]:
        if isinstance(metadata, tuple) and len(metadata) == len(self.connectors):
            return metadata
        return (None,) * len(self.connectors)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending: set[str] = set()
        recving: set[str] = set()
        for connector in self.connectors:
            s, r = connector.get_finished(finished_req_ids)
            sending |= s
            recving |= r
        return sending, recving

    def get_failed_loads(self) -> set[str]:
        return set().union(*(c.get_failed_loads() for c in self.connectors))

    def load_failure_recomputes(self, request: Request) -> bool:
        return any(c.load_failure_recomputes(request) for c in self.connectors)

    def has_pending(self) -> bool:
        return any(c.has_pending() for c in self.connectors)

    def needs_polling(self) -> bool:
        return any(c.needs_polling() for c in self.connectors)

    def cancel_sends(self, request_ids: list[str]) -> None:
        for connector in self.connectors:
            connector.cancel_sends(request_ids)

    def shutdown(self) -> None:
        for connector in self.connectors:
            connector.shutdown()

    def stats(self) -> KVConnectorStats:
        return KVConnectorStats.combined(c.stats() for c in self.connectors)
