"""The adapters one engine serves (`load`ed, until `unload`ed), their weights in memory (up
to `max_cpu_loras` kept, least recently used dropped first, any read again from its folder
when used), and the `max_loras` of them resident in the model's layers, one per slot, for
the step that runs them. A request keeps the weights it started with: an adapter unloaded
while its requests run lets them finish.

`load` and `get` run on any thread (a run-time load runs on the instance's event loop);
`prepare` on the step thread. The scheduler keeps the adapters of one step's running
requests within `max_loras`, so `prepare` always finds them a slot.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pdcluster.engine.config import LoRAConfig
from pdcluster.engine.lora.adapter import LoRAAdapter, LoRAAdapterError, LoRARequest, read_adapter
from pdcluster.engine.lora.layers import LoRABatch, attach_lora
from pdcluster.engine.models.loader import module_name


@dataclass(frozen=True)
class LoRAStats:
    """An engine's adapters (vLLM's `lora_requests_info`): of its running and waiting
    requests, those resident in its layers, and those it serves (loaded, not unloaded)."""

    max_loras: int
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    resident: tuple[str, ...] = ()
    served: tuple[str, ...] = ()


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        shapes: dict[str, tuple[int, int]],
        config: LoRAConfig,
        dtype: torch.dtype,
    ) -> None:
        """`shapes`: `layers.adaptable_shapes` of `model` as loaded (before the runner
        prepared its layers)."""
        self.config = config
        self.dtype = dtype
        self.shapes = shapes
        self._rename = functools.partial(module_name, model=model)
        self.batch = LoRABatch()
        self.targets = attach_lora(
            model, shapes, self.batch, config.max_loras, config.max_lora_rank, dtype
        )
        self._device = next(iter(self.targets.values()))[0].lora_a.device
        self._lock = threading.Lock()
        self._served: dict[str, LoRARequest] = {}  # loaded and not unloaded, by name
        self._unloaded: set[str] = set()  # names unloaded (and not loaded again) here
        self._in_memory: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recent first
        self._slots: list[LoRAAdapter | None] = [None] * config.max_loras
        self._slot_use = OrderedDict.fromkeys(range(config.max_loras))  # least recent first

    # ---- loading (any thread) ----------------------------------------------------------
    def load(self, lora: LoRARequest) -> LoRAAdapter:
        """Serve the adapter from now on, read from its folder unless in memory already;
        LoRAAdapterError when the folder cannot be served or the name is served from another
        folder."""
        with self._lock:
            served = self._served.get(lora.name)
            if served is not None and served != lora:
                raise LoRAAdapterError(
                    f"LoRA adapter {lora.name!r} is loaded from {served.path}, not {lora.path}"
                )
            self._served[lora.name] = lora  # before `get`, which keeps served ones in memory
            self._unloaded.discard(lora.name)
        try:
            return self.get(lora)
        except LoRAAdapterError:
            with self._lock:
                if served is None:
                    del self._served[lora.name]
            raise

    def use(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter of a new request: served from now on (`load`) when its name is new
        here; else its weights only (a request that started before its adapter was
        unloaded, or replaced by another folder under its name, finishes on its own)."""
        with self._lock:
            known = lora.name in self._served or lora.name in self._unloaded
        return self.get(lora) if known else self.load(lora)

    def get(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter's weights: from memory, else read from its folder (and kept, when it
        is served); LoRAAdapterError when the folder cannot be served."""
        with self._lock:
            adapter = self._in_memory.get(lora.name)
            if adapter is not None and adapter.key == lora:
                self._in_memory.move_to_end(lora.name)
                return adapter
        adapter = read_adapter(
            lora, self.shapes, self.config.max_lora_rank, self.dtype, self._rename
        )
        with self._lock:
            if self._served.get(lora.name) == lora:
                self._in_memory[lora.name] = adapter
                while len(self._in_memory) > self.config.cpu_loras:
                    self._in_memory.popitem(last=False)
        return adapter

    def unload(self, name: str) -> bool:
        """Stop serving the adapter (requests running on it finish: they hold its weights);
        whether it was served."""
        with self._lock:
            self._in_memory.pop(name, None)
            self._unloaded.add(name)
            return self._served.pop(name, None) is not None

    def served(self) -> list[str]:
        with self._lock:
            return list(self._served)

    # ---- one step (step thread) --------------------------------------------------------
    def prepare(self, adapters: Sequence[LoRAAdapter | None], num_tokens: Sequence[int]) -> None:
        """Group the step's token rows by adapter (request i: `adapters[i]`, `num_tokens[i]`
        rows, in batch order), each adapter resident in a slot."""
        batch = self.batch
        wanted = {adapter.key for adapter in adapters if adapter is not None}
        if not wanted:
            batch.set(0, None, None)
            return
        groups: dict[int, list[int]] = {}
        start = 0
        for adapter, n in zip(adapters, num_tokens):
            if adapter is not None:
                groups.setdefault(self._slot_for(adapter, wanted), []).extend(
                    range(start, start + n)
                )
            start += n
        size = max(len(rows) for rows in groups.values())
        padded = [groups.get(s, []) for s in range(min(groups), max(groups) + 1)]
        indices = [i for rows in padded for i in rows + [0] * (size - len(rows))]
        valid = [[[1.0]] * len(rows) + [[0.0]] * (size - len(rows)) for rows in padded]
        batch.set(
            min(groups),
            torch.tensor(indices, device=self._device),
            torch.tensor(valid, dtype=self.dtype, device=self._device),
        )

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
            for name, (layer, part) in self.targets.items():
                layer.set_slot(slot, part, adapter.weights.get(name))
            self._slots[slot] = adapter
        self._slot_use.move_to_end(slot)
        return slot
