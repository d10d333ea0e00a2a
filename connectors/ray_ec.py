"""Encoder-output (EC) connector over Ray's object store.

Producer (encoder instance): `save_caches` turns each fresh encoder output into a NumPy
array with its checksum (connectors/checksum.py); the encoder actor returns those
`EncoderOutput`s from its `encode` call, so they land in the object store owned by the caller
(the router) and survive the encoder's death.

Consumer (prefill or mixed instance): a request may carry a handle, the ObjectRef of that
`encode` call. `ensure_cache_available` never blocks: it returns False while the handle's
future is pending; the future's completion calls `wake` (the instance's step loop sleeps
meanwhile). Once they are local they are loaded into the encoder cache
with no local encoder run, each checked against its checksum first. A failed, late or
corrupt handle makes the instance encode locally.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from pdcluster.connectors import faults
from pdcluster.connectors.base import ECConnectorBase
from pdcluster.connectors.checksum import digest
from pdcluster.connectors.stats import ECStats
from pdcluster.engine.outputs import SchedulerOutput
from pdcluster.engine.request import Request


@dataclass(frozen=True)
class EncoderOutput:
    """One image's encoder output as E's `encode` returns it: the array and its checksum."""

    array: np.ndarray
    digest: int

    def intact(self) -> bool:
        return (
            isinstance(self.array, np.ndarray)
            and self.array.flags.c_contiguous
            and digest(self.array) == self.digest
        )


@dataclass
class _Handle:
    future: concurrent.futures.Future  # -> dict[mm_hash, np.ndarray]
    first_polled: float = field(default_factory=time.monotonic)


class RayECConnector(ECConnectorBase):
    def __init__(
        self,
        role: str,
        timeout_s: float = 30.0,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        wake: Callable[[], None] | None = None,
    ) -> None:
        if role not in ("producer", "consumer"):
            raise ValueError(f"EC connector role must be producer or consumer, not {role!r}")
        self.role = role
        self.timeout_s = timeout_s
        self.device = device or torch.device("cpu")
        self.dtype = dtype
        self.wake = wake  # called, from a Ray thread, when a handle's outputs have landed
        self.outbox: dict[str, EncoderOutput] = {}  # producer: mm_hash -> fresh encoder output
        self._handles: dict[str, _Handle] = {}  # consumer: request id -> in-flight handle
        self._ready: dict[str, np.ndarray] = {}  # consumer: mm_hash -> output ready to load
        self._ready_for: dict[str, set[str]] = {}  # consumer: request id -> its ready hashes
        self._to_load: list[str] = []
        self.num_loaded = 0
        self.num_fallbacks = 0  # handles that failed or timed out: encoded locally instead
        self.num_checksum_failures = 0  # of those, handles whose outputs were corrupt
        self.bytes_loaded = 0

    # ---- producer --------------------------------------------------------------------
    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        if self.role != "producer":  # a consumer's local encodes stay local
            return
        array = np.ascontiguousarray(encoder_cache[mm_hash].detach().float().cpu().numpy())
        checksum = digest(array)
        if faults.strike(faults.Fault.CORRUPT_ENCODER_OUTPUT):
            array = faults.flipped(array)
        self.outbox[mm_hash] = EncoderOutput(array, checksum)

    def take_outputs(self, mm_hashes: list[str]) -> dict[str, EncoderOutput]:
        return {h: self.outbox[h] for h in mm_hashes if h in self.outbox}

    def clear_outbox(self) -> None:
        """After a step's outputs were handed out: the store holds them now."""
        self.outbox.clear()

    # ---- consumer: scheduler side ----------------------------------------------------
    def add_handle(self, request_id: str, handle: list[ray.ObjectRef] | None) -> None:
        """Register the encode call's ref (wrapped in a list so Ray never resolves it)."""
        if handle:
            future = handle[0].future()
            if self.wake is not None:
                future.add_done_callback(lambda _: self.wake())
            self._handles[request_id] = _Handle(future)

    def awaits_outputs(self, request_id: str) -> bool:
        handle = self._handles.get(request_id)
        return handle is not None and not handle.future.done()

    def has_cache_item(self, mm_hash: str) -> bool:
        return mm_hash in self._ready

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        handle = self._handles.get(request.request_id)
        if handle is None:
            return True  # nothing in flight: load what is ready, encode the rest locally
        needed = [f for f in request.mm_features if f.end > num_computed_tokens]
        if not needed or all(f.mm_hash in self._ready for f in needed):
            return True
        if not handle.future.done():
            if time.monotonic() - handle.first_polled < self.timeout_s:
                return False
            return self._give_up(request.request_id)
        if handle.future.exception() is not None:  # the encoder died or failed
            return self._give_up(request.request_id)
        outputs = handle.future.result()
        if not all(isinstance(out, EncoderOutput) and out.intact() for out in outputs.values()):
            self.num_checksum_failures += 1
            return self._give_up(request.request_id)
        self._ready.update((mm_hash, out.array) for mm_hash, out in outputs.items())
        self._ready_for[request.request_id] = set(outputs)
        del self._handles[request.request_id]
        return True

    def _give_up(self, request_id: str) -> bool:
        """The encoder died, lost its output or is too late: encode locally."""
        del self._handles[request_id]
        self.num_fallbacks += 1
        return True

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self._to_load.append(request.mm_features[index].mm_hash)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> list[str]:
        to_load, self._to_load = self._to_load, []
        return to_load

    # ---- consumer: worker side -------------------------------------------------------
    def start_load_caches(self, metadata: Any, encoder_cache: dict[str, torch.Tensor]) -> None:
        for mm_hash in metadata or ():
            array = self._ready.pop(mm_hash, None)
            if array is None:
                continue  # loaded already for another request this step
            # One copy out of the read-only store into the instance's own memory.
            encoder_cache[mm_hash] = torch.tensor(array, dtype=self.dtype, device=self.device)
            self.num_loaded += 1
            self.bytes_loaded += array.nbytes

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        for request_id in finished_req_ids:
            self._handles.pop(request_id, None)
            for mm_hash in self._ready_for.pop(request_id, ()):
                if not any(mm_hash in hashes for hashes in self._ready_for.values()):
                    self._ready.pop(mm_hash, None)  # never loaded: the request went away
        return set(), set()

    def stats(self) -> ECStats:
        return ECStats(
            len(self._handles),
            self.num_loaded,
            self.num_fallbacks,
            self.bytes_loaded,
            self.num_checksum_failures,
        )

    def shutdown(self) -> None:
        self.outbox.clear()
        self._handles.clear()
        self._ready.clear()
        self._ready_for.clear()
        self._to_load.clear()
