"""The model's projections with LoRA: each keeps its base layer and, per resident adapter
slot, the adapter's A and B matrices, and adds (B A x) * scale to the rows of that slot's
requests. One step's rows are grouped by adapter (`LoRABatch`, set by the manager before
the forward pass): a gathered low-rank product per adapter group, the base rows untouched.

Wrapped before the runner packs or quantizes the base layers (they pack under `base`), so
any weight format takes adapters; LoRA runs at tensor_parallel_size 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    """This step's token rows per adapter slot; empty when no scheduled request has one."""

    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)


class LoRALinear(nn.Module):
    """`base` plus, for each of `max_loras` slots, a rank <= `max_rank` adapter."""

    def __init__(self, base: nn.Linear, batch: LoRABatch, max_loras: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.in_features, self.out_features = base.in_features, base.out_features
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_a = torch.zeros(max_loras, max_rank, self.in_features, **like)
        self.lora_b = torch.zeros(max_loras, self.out_features, max_rank, **like)
        self.ranks = [0] * max_loras  # 0: the slot's adapter leaves this projection alone
        self.scales = [0.0] * max_loras

    def set_slot(self, slot: int, weights: LoRAWeights | None) -> None:
        """Hold `weights` in `slot` (None: nothing for this projection)."""
        rank = 0 if weights is None else weights.rank
        if weights is not None:
            self.lora_a[slot, :rank].copy_(weights.a)
            self.lora_b[slot, :, :rank].copy_(weights.b)
        self.ranks[slot] = rank
        self.scales[slot] = 0.0 if weights is None else weights.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for slot, rows in self.batch.groups:
            rank = self.ranks[slot]
            if rank:
                a, b = self.lora_a[slot, :rank], self.lora_b[slot, :, :rank]
                out[rows] += F.linear(F.linear(x[rows], a), b) * self.scales[slot]
        return out


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
