"""Weight-quantized linear layers for CPU decoding (`quantization="int8"`).

A decode step at a few rows reads every weight once, so its matmuls cost what their weights
weigh. `Int8Linear` holds a weight as int8 with one float scale per output row (symmetric,
per channel) in fbgemm's packed layout and multiplies with `quantized::linear_dynamic`, which
quantizes each input to 8 bits on the fly (float32 in, float32 out). That reads a quarter of
float32's bytes and runs on AVX2's integer dot products.

Whether a layer is worth it is measured at load, per layer shape: the int8 kernel replaces the
float32 one (packed or plain) only where it is faster at both 1 row and `BATCH_HINT` rows.
Results are not exact: tests/test_quantization.py bounds greedy agreement, top-logprob
closeness and perplexity against float32. float32 (`quantization="none"`) stays exact.
"""

from __future__ import annotations

import time
import warnings

import torch
from torch import nn

from engine.models.packed_linear import BATCH_HINT, PackedLinear

TIMED_ROWS = (1, BATCH_HINT)  # input rows a layer's kernels are timed at
NUM_TIMED_CALLS = 5  # calls per timing; the best of NUM_TIMINGS timings counts
NUM_TIMINGS = 3


def int8_available() -> bool:
    """Whether this torch build has fbgemm's dynamic int8 linear."""
    return "fbgemm" in torch.backends.quantized.supported_engines


class Int8Linear(nn.Module):
    """`y ~= x @ W.T + b` with W as per-channel int8 in fbgemm's layout. Build with
    `from_weight`. `.weight` gives the dequantized [out, in] float32 weight."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self._packed = packed  # fbgemm's opaque packed weight
        self.bias = bias  # [out] float32 or None
        qweight, _ = torch.ops.quantized.linear_unpack(packed)
        self.out_features, self.in_features = qweight.shape

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
        weight = weight.detach().float()  # [out, in]
        scales = weight.abs().amax(dim=1).clamp(min=1e-12).double() / 127  # [out]
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated, fbgemm's ops not
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qweight, None)
        return cls(packed, None if bias is None else bias.detach().float())

    @property
    def weight(self) -> torch.Tensor:
        qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return qweight.dequantize()

    @property
    def nbytes(self) -> int:
        """Bytes the packed weight holds (int8 values, one scale per row)."""
        return self.in_features * self.out_features + 8 * self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()  # [N, in]
        # fbgemm quantizes its whole input with one scale; dividing each row by its own
        # largest |value| first gives every row (a prompt's outlier tokens too) all 7 bits.
        row_scales = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)  # [N, 1]
        out = torch.ops.quantized.linear_dynamic(rows / row_scales, self._packed, True)
        out = out * row_scales if self.bias is None else torch.addcmul(self.bias, out, row_scales)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)  # [..., out]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def _best_time_s(layer: nn.Module, rows: int) -> float:
    x = torch.randn(rows, layer.in_features)
    layer(x)  # warm-up: first-call allocations
    best = float("inf")
    for _ in range(NUM_TIMINGS):
        start = time.perf_counter()
        for _ in range(NUM_TIMED_CALLS):
            layer(x)
        best = min(best, time.perf_counter() - start)
    return best


@torch.no_grad()
def measures_faster(candidate: nn.Module, current: nn.Module) -> bool:
    """Whether `candidate` takes less time than `current` over one call at each row count of
    TIMED_ROWS (each the best of NUM_TIMINGS, the two interleaved, so that a noisy neighbour
    does not decide alone)."""
    candidate_s = current_s = 0.0
    for rows in TIMED_ROWS:
        candidate_s += _best_time_s(candidate, rows)
        current_s += _best_time_s(current, rows)
    return candidate_s < current_s


def _float_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, PackedLinear))
    ]


def quantize_linears(model: nn.Module) -> int:
    """Swap each float32 linear of `model` for an `Int8Linear` where that measures faster, in
    place; layers of one shape share one measurement. A weight another module also reads (a
    tied lm_head's embedding) stays there too. Returns how many layers were swapped (0 when
    fbgemm is missing)."""
    if not int8_available():
        return 0
    faster: dict[tuple[type, int, int, bool], bool] = {}  # (kind, in, out, bias) -> int8 wins
    num_swapped = 0
    for name, linear in _float_linears(model):
        int8 = Int8Linear.from_weight(linear.weight, linear.bias)
        shape = (type(linear), linear.in_features, linear.out_features, linear.bias is not None)
        if shape not in faster:
            faster[shape] = measures_faster(int8, linear)
        if faster[shape]:
            model.set_submodule(name, int8)
            num_swapped += 1
    return num_swapped
