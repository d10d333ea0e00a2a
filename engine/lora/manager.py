"""The adapters one engine serves: those loaded into memory (up to `max_cpu_loras` kept,
least recently used dropped first, any reloadable from its folder) and the `max_loras` of
them resident in the model's layers, one per slot, for the step that runs them.

`load` runs on the instance's event loop (a run-time load, checked before any request uses
it); everything else on the step thread. The scheduler keeps the adapters of one step's
running requests within `max_loras`, so `prepare` always finds them a slot.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pdcluster.engine.config import LoRAConfig
from pdcluster.engine.lora.adapter import LoRAAdapter, LoRAAdapterError, LoRARequest, read_adapter
from pdcluster.engine.lora.layers import LoRABatch, attach_lora


@dataclass(frozen=True)
class LoRAStats:
    """An engine's adapters (vLLM's `lora_requests_info`): of its running and waiting
    requests, and those resident in its layers."""

    max_loras: int
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    resident: tuple[str, ...] = ()


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype) -> None:
        self.config = config
        self.dtype = dtype
        self.batch = LoRABatch()
        self.layers = attach_lora(model, self.batch, config.max_loras, config.max_lora_rank)
        self.shapes = {n: (m.in_features, m.out_features) for n, m in self.layers.items()}
        self._lock = threading.Lock()
        self._loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recent first
        self._slots: list[LoRAAdapter | None] = [None] * config.max_loras
        self._slot_use = OrderedDict.fromkeys(range(config.max_loras))  # least recent first

    # ---- loading (any thread) ----------------------------------------------------------
    def load(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter, read from its folder unless loaded already; LoRAAdapterError when
        the folder cannot be served or the name is loaded from another folder."""
        with self._lock:
            adapter = self._loaded.get(lora.name)
            if adapter is not None:
                if adapter.path != lora.path:
                    raise LoRAAdapterError(
                        f"LoRA adapter {lora.name!r} is loaded from {adapter.path}, not {lora.path}"
                    )
                self._loaded.move_to_end(lora.name)
                return adapter
        adapter = read_adapter(lora, self.shapes, self.config.max_lora_rank, self.dtype)
        with self._lock:
            self._loaded[lora.name] = adapter
            self._loaded.move_to_end(lora.name)
            while len(self._loaded) > self.config.cpu_loras:
                self._loaded.popitem(last=False)
        return adapter

    def unload(self, name: str) -> bool:
        """Forget the adapter (requests still running on it finish: they carry its folder);
        whether it was loaded."""
        with self._lock:
            return self._loaded.pop(name, None) is not None

    def loaded(self) -> list[str]:
        with self._lock:
            return list(self._loaded)

    # ---- one step (step thread) --------------------------------------------------------
    def prepare(self, loras: Sequence[LoRARequest | None], num_tokens: Sequence[int]) -> None:
        """Group the step's token rows by adapter (request i: `loras[i]`, `num_tokens[i]`
        rows, in batch order), each adapter resident in a slot."""
        rows: dict[int, list[int]] = {}
        start = 0
        wanted = {lora for lora in loras if lora is not None}
        for lora, n in zip(loras, num_tokens):
            if lora is not None:
                slot = self._slot_for(self.load(lora), wanted)
                rows.setdefault(slot, []).extend(range(start, start + n))
            start += n
        self.batch.groups = [(slot, _rows(r)) for slot, r in rows.items()]

    def resident(self) -> tuple[str, ...]:
        return tuple(a.name for a in self._slots if a is not None)

    def _slot_for(self, adapter: LoRAAdapter, wanted: set[LoRARequest]) -> int:
        """The slot holding `adapter`, else the least recently used one not `wanted` now."""
        slot = next((i for i, a in enumerate(self._slots) if a and a.key == adapter.key), None)
        if slot is None:
            slot = next(
                i for i in self._slot_use
                if self._slots[i] is None or self._slots[i].key not in wanted
            )  # fmt: skip
            for name, layer in self.layers.items():
                layer.set_slot(slot, adapter.weights.get(name))
            self._slots[slot] = adapter
        self._slot_use.move_to_end(slot)
        return slot


def _rows(rows: list[int]) -> slice | torch.Tensor:
    """The rows as a slice when they are one run (a view, no gather), else an index."""
    if rows[-1] - rows[0] + 1 == len(rows):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.long)
