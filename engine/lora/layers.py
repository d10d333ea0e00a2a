"""The model's projections with LoRA: each keeps its base layer and, per resident adapter
slot, the adapter's A and B matrices, and adds (B A x) * scale to the rows of that slot's
requests. The manager groups one step's rows by slot before the forward pass (`LoRABatch`),
and every adapter of the step is applied at once: the rows gathered into one padded group
per slot, two batched matmuls with the slots' A and B (a gathered low-rank product per
adapter group: each row costs its own adapter's rank only), scaled, and added back to their
rows. Six tensor ops per projection, whatever the number of adapters in the step; the base
model's rows are not touched.

Wrapped after the runner prepared the base layers, whatever their format: a fused layer
(q, k and v in one, gate and up in one) takes each part's adapter in its own block of A and
B, and a whole-layer decode kernel runs the steps whose rows have no adapter. LoRA runs at
tensor_parallel_size 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.lora.adapter import LoRAWeights
from pdcluster.engine.models.decode_kernel import DecodeKernel
from pdcluster.engine.models.fusion import FUSIBLE
from pdcluster.engine.models.llama import DecoderAttention, DecoderLayer
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
    """`base` (one projection, or several fused: `parts` gives each one's output width, in
    order) plus, for each of `max_loras` slots, an adapter of rank <= `max_rank` per part."""

    def __init__(
        self,
        base: nn.Module,
        batch: LoRABatch,
        in_features: int,
        parts: tuple[int, ...],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.max_rank = max_rank
        self.in_features, self.parts = in_features, parts
        self.offsets = [sum(parts[:i]) for i in range(len(parts))]
        like = {"dtype": dtype, "device": _device(base)}
        width, out = max_rank * len(parts), sum(parts)
        # per slot A^T and B^T, part p in rank block p (block-diagonal in B): what lies past
        # an adapter's rank, and off a part's block, is zero and adds exact zeros
        self.lora_a = torch.zeros(max_loras, in_features, width, **like)
        self.lora_b = torch.zeros(max_loras, width, out, **like)
        self.scales = torch.zeros(max_loras, 1, out, **like)  # each output column's part's

    def set_slot(self, slot: int, part: int, weights: LoRAWeights | None) -> None:
        """Hold `weights` for part `part` in `slot` (None: nothing for that part)."""
        ranks = slice(part * self.max_rank, (part + 1) * self.max_rank)
        cols = slice(self.offsets[part], self.offsets[part] + self.parts[part])
        self.lora_a[slot, :, ranks].zero_()
        self.lora_b[slot, ranks, cols].zero_()
        self.scales[slot, :, cols] = 0.0
        if weights is not None:
            rank = weights.rank
            self.lora_a[slot, :, ranks.start : ranks.start + rank].copy_(weights.a.t())
            self.lora_b[slot, ranks.start : ranks.start + rank, cols].copy_(weights.b.t())
            self.scales[slot, :, cols] = weights.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.batch
        if batch.rows is None:
            return out
        slots = slice(batch.first, batch.first + batch.valid.shape[0])
        low = torch.bmm(batch.grouped(x), self.lora_a[slots])  # [G, M, parts * rank]
        delta = torch.bmm(low, self.lora_b[slots]).mul_(self.scales[slots]).mul_(batch.valid)
        return out.index_add_(0, batch.rows, delta.view(-1, out.shape[-1]))


class LoRAGuardedKernel:
    """A layer's whole-layer decode kernel, for the steps whose rows have no adapter."""

    def __init__(self, kernel: DecodeKernel, batch: LoRABatch) -> None:
        self.kernel, self.batch = kernel, batch

    def takes(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        return self.batch.rows is None and self.kernel.takes(x, kv_cache, meta)

    def __call__(self, *args: torch.Tensor | AttentionMetadata) -> torch.Tensor:
        return self.kernel(*args)


# A projection that takes adapters: the wrapper holding it and its part there
Target = tuple[LoRALinear, int]


def adaptable_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(in, out) of every projection of `model` that takes adapters, by module name, read
    from its checkpoint layers before the runner packs or fuses them."""
    return {
        f"{name}.{attr}": (layer.in_features, layer.out_features)
        for name, module, attrs in _projections(model)
        for attr in attrs
        if isinstance(layer := getattr(module, attr), nn.Linear)
    }


def attach_lora(
    model: nn.Module,
    shapes: dict[str, tuple[int, int]],
    batch: LoRABatch,
    max_loras: int,
    max_rank: int,
    dtype: torch.dtype,
) -> dict[str, Target]:
    """Wrap every projection of `shapes` in `model` (fused ones as one LoRALinear of their
    parts), reading `batch`, and guard the layers' decode kernels; module name -> target."""
    targets: dict[str, Target] = {}
    for name, module, attrs in _projections(model):
        fused_name, fused_parts = next(v for t, v in FUSIBLE.items() if isinstance(module, t))
        groups = [(attr, (attr,)) for attr in attrs if getattr(module, attr) is not None]
        if getattr(module, fused_name, None) is not None:
            groups.append((fused_name, fused_parts))
        for attr, parts in groups:
            names = [f"{name}.{part}" for part in parts]
            in_features = shapes[names[0]][0]
            widths = tuple(shapes[n][1] for n in names)
            layer = LoRALinear(
                getattr(module, attr), batch, in_features, widths, max_loras, max_rank, dtype
            )
            setattr(module, attr, layer)
            targets.update({n: (layer, i) for i, n in enumerate(names)})
    if not targets:
        raise ValueError(f"{type(model).__name__} has no projection LoRA applies to")
    for layer in model.modules():
        if isinstance(layer, DecoderLayer) and layer.decode_kernel is not None:
            layer.decode_kernel = LoRAGuardedKernel(layer.decode_kernel, batch)
    return targets


def _projections(model: nn.Module) -> list[tuple[str, nn.Module, tuple[str, ...]]]:
    """(name, module, its projection attributes) of each attention and dense MLP of `model`;
    the experts of a sparse MoE are left out (their rows are not the batch's)."""
    found = []
    for name, module in model.named_modules():
        attrs = next((a for t, a in LORA_PROJECTIONS.items() if isinstance(module, t)), None)
        if attrs is not None and ".experts." not in f"{name}.":
            found.append((name, module, attrs))
    return found


def _device(layer: nn.Module) -> torch.device:
    tensors = [*layer.parameters(), *layer.buffers()]
    return tensors[0].device if tensors else torch.device("cpu")
