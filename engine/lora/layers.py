"""The model's projections with LoRA: each keeps its base layer and, per resident adapter
slot, the adapter's A and B matrices, and adds (B A x) * scale to the rows of that slot's
requests. One step's rows are mapped to their slots (`LoRABatch`, set by the manager before
the forward pass), and every adapter of the step is applied at once: x times every slot's A
(zero rows past an adapter's rank), each row's own slot kept by a mask, times every slot's
B, scaled per row. Five tensor ops per projection, whatever the number of adapters in the
step; the base model's rows get an exact zero added.

Wrapped before the runner packs or quantizes the base layers (they pack under `base`), so
any weight format takes adapters; LoRA runs at tensor_parallel_size 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.lora.adapter import LoRAWeights
from pdcluster.engine.models.llama import DecoderAttention
from pdcluster.engine.models.mlp import GatedMLP

# module type -> the projections of it that take adapters
LORA_PROJECTIONS: dict[type[nn.Module], tuple[str, ...]] = {
    DecoderAttention: ("q_proj", "k_proj", "v_proj", "o_proj"),
    GatedMLP: ("gate_proj", "up_proj", "down_proj"),
}


@dataclass
class LoRABatch:
    """This step's rows and their slots; `slots` is None when no row has an adapter."""

    slots: torch.Tensor | None = None  # [T] each row's slot, max_loras for the base model
    mask: torch.Tensor | None = None  # [T, max_loras * max_rank] 1 on the row's slot's columns


class LoRALinear(nn.Module):
    """`base` plus, for each of `max_loras` slots, a rank <= `max_rank` adapter."""

    def __init__(self, base: nn.Linear, batch: LoRABatch, max_loras: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.max_rank = max_rank
        self.in_features, self.out_features = base.in_features, base.out_features
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        # every slot's A, stacked ([slot * max_rank + i] is row i of the slot's A), and B
        self.lora_a = torch.zeros(max_loras * max_rank, self.in_features, **like)
        self.lora_b = torch.zeros(self.out_features, max_loras * max_rank, **like)
        self.scales = torch.zeros(max_loras + 1, **like)  # [max_loras]: the base model's 0

    def set_slot(self, slot: int, weights: LoRAWeights | None) -> None:
        """Hold `weights` in `slot` (None: nothing for this projection)."""
        cols = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        self.lora_a[cols].zero_()
        self.lora_b[:, cols].zero_()
        self.scales[slot] = 0.0
        if weights is not None:
            rank = weights.rank
            self.lora_a[cols.start : cols.start + rank].copy_(weights.a)
            self.lora_b[:, cols.start : cols.start + rank].copy_(weights.b)
            self.scales[slot] = weights.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.batch
        if batch.slots is None:
            return out
        low = F.linear(x, self.lora_a) * batch.mask  # [T, slots * rank]: each row's own
        delta = F.linear(low, self.lora_b) * self.scales[batch.slots][:, None]
        return out.add_(delta)


def attach_lora(
    model: nn.Module, batch: LoRABatch, max_loras: int, max_rank: int
) -> dict[str, LoRALinear]:
    """Wrap every LORA_PROJECTIONS layer of `model` (experts of a sparse MoE excepted: their
    rows are not the batch's) in a LoRALinear reading `batch`; module name -> the wrapper."""
    wrapped: dict[str, LoRALinear] = {}
    for name, module in list(model.named_modules()):
        projections = next((p for t, p in LORA_PROJECTIONS.items() if isinstance(module, t)), ())
        if ".experts." in f"{name}.":
            continue
        for attr in projections:
            base = getattr(module, attr)
            if not isinstance(base, nn.Linear):
                raise ValueError(f"LoRA needs {name}.{attr} as a plain linear layer")
            layer = LoRALinear(base, batch, max_loras, max_rank)
            setattr(module, attr, layer)
            wrapped[f"{name}.{attr}"] = layer
    if not wrapped:
        raise ValueError(f"{type(model).__name__} has no projection LoRA applies to")
    return wrapped
