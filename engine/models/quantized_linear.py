"""Weight-only int8 linear layers for CPU decoding (`quantization="int8"`).

A decode step at a few rows reads every weight once, so its matmuls cost what their weights
weigh. `Int8Linear` holds a weight as int8 with one scale per output row (symmetric, per
channel) and multiplies with `torch._weight_int8pack_mm` on bfloat16 activations: a quarter of
float32's bytes read, and activations keep bf16's relative precision (quantizing them to 8 bits
too, as fbgemm's dynamic linear does, measured +13% perplexity on SmolLM2; this, +0.2%).

That kernel converts through bf16, which this kind of CPU (AVX2, no native bf16) does slowly
on many rows, so each swapped layer keeps its float32 twin for larger batches: the most rows
int8 serves (`max_rows`) is measured at load, per layer shape, over ROW_BUCKETS (the largest
bucket up to which int8 is faster at every bucket); a shape where int8 is never faster keeps
float32 alone. Weights then take 1.25x float32's memory. The race reads its weights from
memory, as a step does (a model's weights outgrow the CPU caches): each timed call runs on
another copy of the weights, with COLD_BYTES of float32 copies in all (MAX_COPIES at most).
Timed on cache-hot weights, a 3072x576 float32 layer read at ~46 GB/s here and beat int8 at
one row. Results are not exact: tests/test_quantization.py bounds greedy agreement, top-logprob closeness and perplexity
against float32. float32 (`quantization="none"`) stays the exact mode.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.fusion import fuse_projections
from engine.models.packed_linear import PackedLinear

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16)  # input rows the kernels are timed at
NUM_TIMINGS = 3  # the best of these counts; each calls every copy once
COLD_BYTES = 96 * 1024**2  # float32 bytes of the copies: beyond a server CPU's last-level cache
MAX_COPIES = 32  # a small model's layers stay as cache-hot as its whole step keeps them
# Largest allowed |int8 - float32| relative to the largest |float32| output at load, on
# random inputs: per-channel int8 with bf16 activations stays within ~1% at these sizes.
CHECK_TOL = 0.03


def int8_available() -> bool:
    """Whether this torch build has the weight-only int8 matmul."""
    return hasattr(torch, "_weight_int8pack_mm")


class Int8Linear(nn.Module):
    """`y ~= x @ W.T + b` with W as per-channel int8, for inputs of up to `max_rows` rows;
    larger inputs go to `float_layer` (the float32 layer it replaced). Build with
    `from_layer`."""

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, float_layer: nn.Module, max_rows: int
    ) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight, persistent=False)  # [out, in] int8
        self.register_buffer("scales", scales, persistent=False)  # [out] bf16
        self.float_layer = float_layer
        self.in_features, self.out_features = float_layer.in_features, float_layer.out_features
        self.max_rows = max_rows

    @classmethod
    @torch.no_grad()
    def from_layer(cls, layer: nn.Module) -> Int8Linear | None:
        """The int8 twin of float32 `layer` (serving every row count until measured), or
        None when the kernel cannot run it or its results stray from the layer's."""
        weight = layer.weight.detach().float()  # [out, in]
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # [out]
        qweight = torch.round(weight / scales[:, None]).to(torch.int8)
        int8 = cls(qweight, scales.bfloat16(), layer, max(ROW_BUCKETS))
        x = torch.randn(max(ROW_BUCKETS), layer.in_features, generator=torch.Generator())
        try:
            got = int8(x)
        except RuntimeError:
            return None
        want = F.linear(x, weight, layer.bias)
        return int8 if (got - want).abs().max() <= CHECK_TOL * want.abs().max() else None

    @property
    def weight(self) -> torch.Tensor:
        return self.float_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.float_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [N, in]
        if rows.shape[0] > self.max_rows:
            return self.float_layer(x)
        out = torch._weight_int8pack_mm(rows.bfloat16(), self.qweight, self.scales).float()
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)  # [..., out]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 up to {self.max_rows} rows"


def _best_time_s(layers: list[nn.Module], x: torch.Tensor) -> float:
    """The best of NUM_TIMINGS timings of one call on each of `layers`."""
    layers[0](x)  # warm-up: first-call allocations
    best = float("inf")
    for _ in range(NUM_TIMINGS):
        start = time.perf_counter()
        for layer in layers:
            layer(x)
        best = min(best, time.perf_counter() - start)
    return best


def _copies(int8: Int8Linear) -> tuple[list[nn.Module], list[nn.Module]]:
    """Copies of `int8` and of its float32 layer, enough that their weights come from memory."""
    float_layer = int8.float_layer
    weight = float_layer.weight.detach()  # a packed layer's: unpacked once, here
    count = min(MAX_COPIES, -(-COLD_BYTES // (weight.numel() * weight.element_size())))
    floats = [float_layer] + [_float_copy(float_layer, weight) for _ in range(count - 1)]
    int8s = [int8] + [
        Int8Linear(int8.qweight.clone(), int8.scales, layer, int8.max_rows) for layer in floats[1:]
    ]
    return int8s, floats


def _float_copy(layer: nn.Module, weight: torch.Tensor) -> nn.Module:
    """A float32 layer like `layer` (packed again where it is packed) on a copy of `weight`,
    its dense weight."""
    dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    dense.weight.data = weight.clone()
    if layer.bias is not None:
        dense.bias.data = layer.bias.detach().clone()
    if isinstance(layer, PackedLinear):
        return PackedLinear.from_linear(dense, keep_dense=False) or dense
    return dense


@torch.no_grad()
def measure_max_rows(int8: Int8Linear) -> int:
    """The largest bucket of ROW_BUCKETS up to which `int8` beats its float32 layer at every
    bucket (timings interleaved, each the best of several, so that a noisy neighbour does not
    decide alone; weights read from memory, see `_copies`); 0 when it loses at one row."""
    int8s, floats = _copies(int8)
    max_rows = 0
    for rows in ROW_BUCKETS:
        x = torch.randn(rows, int8.in_features)
        if _best_time_s(int8s, x) >= _best_time_s(floats, x):
            break
        max_rows = rows
    return max_rows


def quantize_linears(model: nn.Module) -> int:
    """Wrap each float32 linear of `model` in an `Int8Linear` where int8 measures faster at
    one row at least, in place; layers of one shape share one measurement. Returns how many
    layers were wrapped (0 when the kernel is missing)."""
    if not int8_available():
        return 0
    max_rows_of: dict[tuple[type, int, int, bool], int] = {}  # (kind, in, out, bias) -> rows
    num_wrapped = 0
    for name, layer in list(model.named_modules()):
        if not isinstance(layer, (nn.Linear, PackedLinear)) or layer.weight.dtype != torch.float32:
            continue
        int8 = Int8Linear.from_layer(layer)
        if int8 is None:
            continue
        shape = (type(layer), layer.in_features, layer.out_features, layer.bias is not None)
        if shape not in max_rows_of:
            max_rows_of[shape] = measure_max_rows(int8)
        int8.max_rows = max_rows_of[shape]
        if int8.max_rows:
            model.set_submodule(name, int8)
            num_wrapped += 1
    limits = {f"{i}x{o}": rows for (_, i, o, _), rows in max_rows_of.items()}
    logger.info("int8 serves up to this many rows per [in x out] shape: %s", limits)
    return num_wrapped


def quantize_int8(model: nn.Module) -> int:
    """What `quantization="int8"` does to a loaded float32 model, in place: sibling
    projections fused (engine/models/fusion.py), then `quantize_linears`. Returns how many
    layers serve int8."""
    fuse_projections(model)
    return quantize_linears(model)
