"""The model's projections with LoRA: each keeps its base layer and, per resident adapter
slot, the adapter's A and B matrices, and adds (B A x) * scale to the rows of that slot's
requests. The manager groups one step's rows by slot before the forward pass (`LoRABatch`),
and every adapter of the step is applied at once: the rows gathered into one padded group
per slot, two batched matmuls with the slots' A and B (a gathered low-rank product per
adapter group: each row costs its own adapter's rank only), scaled, and added back to their
rows. Six tensor ops per projection, whatever the number of adapters in the step; the base
model's rows are not touched.

Wrapped before the runner packs or quantizes the base layers (they pack under `base`), so
any weight format takes adapters; LoRA runs at tensor_parallel_size 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
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
    """This step's rows with an adapter, grouped by slot: slots [first, first + G) hold the
    step's adapters (a slot between them with none of its rows gets padding only); group g
    is `rows[g]` (padded with row 0), `valid[g]` 1 for its real rows, 0 for padding. `rows`
    is None when no row has an adapter."""

    first: int = 0
    rows: torch.Tensor | None = None  # [G * M] row indices, group after group
    valid: torch.Tensor | None = None  # [G, M, 1]
    # the last input gathered and its groups: q, k and v (gate and up) read one input
    _input: torch.Tensor | None = None
    _groups: torch.Tensor | None = None

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x's rows with an adapter, [G, M, in], gathered once per input."""
        if x is not self._input:
            rows = torch.index_select(x, 0, self.rows)
            self._input, self._groups = x, rows.view(self.valid.shape[0], -1, x.shape[-1])
        return self._groups

    def set(self, first: int, rows: torch.Tensor | None, valid: torch.Tensor | None) -> None:
        self.first, self.rows, self.valid = first, rows, valid
        self._input = self._groups = None


class LoRALinear(nn.Module):
    """`base` plus, for each of `max_loras` slots, a rank <= `max_rank` adapter."""

    def __init__(self, base: nn.Linear, batch: LoRABatch, max_loras: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.max_rank = max_rank
        self.in_features, self.out_features = base.in_features, base.out_features
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        # per slot A^T and B^T (zero past the adapter's rank: those terms add exact zeros)
        self.lora_a = torch.zeros(max_loras, self.in_features, max_rank, **like)
        self.lora_b = torch.zeros(max_loras, max_rank, self.out_features, **like)
        self.scales = torch.zeros(max_loras, 1, 1, **like)

    def set_slot(self, slot: int, weights: LoRAWeights | None) -> None:
        """Hold `weights` in `slot` (None: nothing for this projection)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.scales[slot] = 0.0
        if weights is not None:
            rank = weights.rank
            self.lora_a[slot, :, :rank].copy_(weights.a.t())
            self.lora_b[slot, :rank].copy_(weights.b.t())
            self.scales[slot] = weights.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.batch
        if batch.rows is None:
            return out
        slots = slice(batch.first, batch.first + batch.valid.shape[0])
        low = torch.bmm(batch.grouped(x), self.lora_a[slots])  # [G, M, rank]
        delta = torch.bmm(low, self.lora_b[slots]).mul_(self.scales[slots]).mul_(batch.valid)
        return out.index_add_(0, batch.rows, delta.view(-1, self.out_features))


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
