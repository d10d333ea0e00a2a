"""Weight-only int8 and int4 linear layers for CPU decoding (`quantization="int8"|"int4"`).

A decode step at a few rows reads every weight once, so its matmuls cost what their weights
weigh. Both formats multiply bfloat16 activations by quantized weights with torch's weight-only
kernels, and keep activations at bf16's relative precision (quantizing them to 8 bits too, as
fbgemm's dynamic linear does, measured +13% perplexity on SmolLM2; int8 weights, -0.1%):
- `Int8Linear`: int8 with one scale per output row (symmetric, per channel;
  `torch._weight_int8pack_mm`): a quarter of float32's bytes.
- `Int4Linear`: 4 bits with a scale and an offset per GROUP_SIZE inputs of each row
  (asymmetric, from each group's min and max; `torch._weight_int4pack_mm_for_cpu`): an eighth
  of float32's bytes, plus the groups' scales. A GGUF's Q4_1 blocks are this very grid (32
  weights, `d * q + m`), so a Q4_1 checkpoint's weights come back as the file holds them, bar
  bf16's rounding of each group's scale and offset.

Those kernels convert through bf16, which this kind of CPU (AVX2, no native bf16) does slowly
on many rows, so each swapped layer keeps its float32 twin for larger batches: the most rows
the quantized kernel serves (`max_rows`) is measured at load, per layer shape, over ROW_BUCKETS
(the largest bucket up to which it is faster at every bucket); a shape where it is never faster
keeps float32 alone. Weights then take float32's memory and the quantized copy's. The race
reads its weights from memory, as a step does (a model's weights outgrow the CPU caches): each
timed call runs on another copy of the weights, with COLD_BYTES of float32 copies in all
(MAX_COPIES at most). Timed on cache-hot weights, a 3072x576 float32 layer read at ~46 GB/s
here and beat int8 at one row. Results are not exact: tests/test_quantization.py bounds greedy
agreement, top-logprob closeness and perplexity against float32. float32
(`quantization="none"`) stays the exact mode.
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
GROUP_SIZE = 32  # int4: inputs sharing one scale and offset (GGUF's Q4_0/Q4_1 block)


class WeightOnlyLinear(nn.Module):
    """`y ~= x @ W.T + b` with W quantized, for inputs of up to `max_rows` rows; larger inputs
    go to `float_layer` (the float32 layer it replaced). Build with `from_layer`; subclasses
    say how a weight is quantized and multiplied."""

    # Largest allowed |quantized - float32| relative to the largest |float32| output at load,
    # on random inputs: catches a kernel that misreads its layout, not rounding.
    check_tol: float

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, float_layer: nn.Module, max_rows: int
    ) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.float_layer = float_layer
        self.in_features, self.out_features = float_layer.in_features, float_layer.out_features
        self.max_rows = max_rows

    @staticmethod
    def available() -> bool:
        """Whether this torch build has the format's kernel."""
        raise NotImplementedError

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(qweight, scales) for float32 `weight` [out, in], or None for a shape the kernel
        cannot take."""
        raise NotImplementedError

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` [N, in] bf16 times the quantized weight: [N, out] bf16."""
        raise NotImplementedError

    @classmethod
    @torch.no_grad()
    def from_layer(cls, layer: nn.Module) -> WeightOnlyLinear | None:
        """The quantized twin of float32 `layer` (serving every row count until measured),
        or None when the kernel cannot run it or its results stray from the layer's."""
        weight = layer.weight.detach().float()  # [out, in]
        quantized = cls.quantize(weight)
        if quantized is None:
            return None
        twin = cls(*quantized, layer, max(ROW_BUCKETS))
        x = torch.randn(max(ROW_BUCKETS), layer.in_features, generator=torch.Generator())
        try:
            got = twin(x)
        except RuntimeError:
            return None
        want = F.linear(x, weight, layer.bias)
        return twin if (got - want).abs().max() <= cls.check_tol * want.abs().max() else None

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
        out = self.matmul(rows.bfloat16()).float()
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)  # [..., out]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"quantized up to {self.max_rows} rows"
        )


class Int8Linear(WeightOnlyLinear):
    """int8 weights, one bf16 scale per output row (symmetric)."""

    check_tol = 0.03  # per-channel int8 with bf16 activations stays within ~1% here

    @staticmethod
    def available() -> bool:
        return hasattr(torch, "_weight_int8pack_mm")

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # [out]
        qweight = torch.round(weight / scales[:, None]).to(torch.int8)  # [out, in]
        return qweight, scales.bfloat16()

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(rows, self.qweight, self.scales)


class Int4Linear(WeightOnlyLinear):
    """4-bit weights, a bf16 scale and offset per GROUP_SIZE inputs of each row: weight
    `(q - 8) * scale + offset`, q in 0..15, each group's min at q = 0 and max at q = 15."""

    check_tol = 0.15  # 16 levels per group: random inputs see ~5-8% here, a misread ~100%

    @staticmethod
    def available() -> bool:
        return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(
            torch, "_convert_weight_to_int4pack_for_cpu"
        )

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        out_features, in_features = weight.shape
        if out_features % 16 or in_features % GROUP_SIZE:  # the packed layout's tiles
            return None
        groups = weight.view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [out, groups]
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        packed = torch._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).view(out_features, in_features), 1
        )
        offset = low + 8 * scale  # the kernel centres q on 8
        scales_and_offsets = torch.stack([scale.t(), offset.t()], dim=-1)  # [groups, out, 2]
        return packed, scales_and_offsets.contiguous().bfloat16()

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(rows, self.qweight, GROUP_SIZE, self.scales)


# quantization name -> its layer
FORMATS: dict[str, type[WeightOnlyLinear]] = {"int8": Int8Linear, "int4": Int4Linear}
# The output head (`...lm_head`) keeps 8 bits in every mode, as GPTQ and AWQ leave it unquantized
# and llama.cpp's Q4 files store it at 6-8 bits: its errors land on the logits directly (int4
# there took SmolLM2's greedy agreement with float32 from ~60 to ~40 of 64 tokens).
HEAD, HEAD_FORMAT = "lm_head", Int8Linear


def format_of(name: str, quantization: str) -> type[WeightOnlyLinear]:
    """The layer that quantizes the linear named `name` in mode `quantization`."""
    return HEAD_FORMAT if name.rsplit(".", 1)[-1] == HEAD else FORMATS[quantization]


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


def _copies(twin: WeightOnlyLinear) -> tuple[list[nn.Module], list[nn.Module]]:
    """Copies of `twin` and of its float32 layer, enough that their weights come from memory."""
    float_layer = twin.float_layer
    weight = float_layer.weight.detach()  # a packed layer's: unpacked once, here
    count = min(MAX_COPIES, -(-COLD_BYTES // (weight.numel() * weight.element_size())))
    floats = [float_layer] + [_float_copy(float_layer, weight) for _ in range(count - 1)]
    kind = type(twin)
    twins = [twin] + [
        kind(twin.qweight.clone(), twin.scales, layer, twin.max_rows) for layer in floats[1:]
    ]
    return twins, floats


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
def measure_max_rows(twin: WeightOnlyLinear) -> int:
    """The largest bucket of ROW_BUCKETS up to which `twin` beats its float32 layer at every
    bucket (timings interleaved, each the best of several, so that a noisy neighbour does not
    decide alone; weights read from memory, see `_copies`); 0 when it loses at one row."""
    twins, floats = _copies(twin)
    max_rows = 0
    for rows in ROW_BUCKETS:
        x = torch.randn(rows, twin.in_features)
        if _best_time_s(twins, x) >= _best_time_s(floats, x):
            break
        max_rows = rows
    return max_rows


def quantize_linears(model: nn.Module, quantization: str) -> int:
    """Wrap each float32 linear of `model` in its `format_of` layer where that measures faster
    at one row at least, in place; layers of one shape and format share one measurement.
    Returns how many layers were wrapped (none where a kernel is missing)."""
    # (format, layer type, in, out, bias) -> rows
    max_rows_of: dict[tuple[type, type, int, int, bool], int] = {}
    num_wrapped = 0
    for name, layer in list(model.named_modules()):
        if not isinstance(layer, (nn.Linear, PackedLinear)) or layer.weight.dtype != torch.float32:
            continue
        kind = format_of(name, quantization)
        twin = kind.from_layer(layer) if kind.available() else None
        if twin is None:
            continue
        shape = (kind, type(layer), layer.in_features, layer.out_features, layer.bias is not None)
        if shape not in max_rows_of:
            max_rows_of[shape] = measure_max_rows(twin)
        twin.max_rows = max_rows_of[shape]
        if twin.max_rows:
            model.set_submodule(name, twin)
            num_wrapped += 1
    limits = {f"{k.__name__} {i}x{o}": rows for (k, _, i, o, _), rows in max_rows_of.items()}
    logger.info("quantized kernels serve up to this many rows per [in x out] shape: %s", limits)
    return num_wrapped


def quantize_model(model: nn.Module, quantization: str) -> int:
    """What `quantization="int8"` or `"int4"` does to a loaded float32 model, in place:
    sibling projections fused (engine/models/fusion.py), then `quantize_linears`. Returns how
    many layers serve a quantized format."""
    fuse_projections(model)
    return quantize_linears(model, quantization)
