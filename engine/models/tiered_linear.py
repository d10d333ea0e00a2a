"""CPU linear layers held in the weight formats that multiply them fastest, chosen per layer
shape and row count by measurement at load.

Which format is fastest depends on how many rows a call multiplies and on the CPU. A decode
step at a few rows reads every weight once, so fewer bytes win there (int4, int8); a batch of
32 rows or a prefill chunk is bound by arithmetic, where the weight-only kernels (which
dequantize per block of rows) lose to oneDNN's packed bf16 or float32 products. Measured on one
core of an AVX512-BF16 EPYC (µs per call, weights read from memory), for example:

    [960 x 576]  rows:   1     16     32     64
    float32            88    144    241    386
    bf16               47     89    134    208
    int8 (bf16 act.)   43    144    287    545

So in the non-exact modes each linear becomes a `TieredLinear`: the formats its mode allows
(`quantization`'s, then each of `weight_dtypes`), each serving the row counts of ROW_BUCKETS at
which it was timed fastest; a format that wins no bucket is not kept. Layers of one shape and
one set of formats share one measurement. The race reads weights from memory, as a step does
(a model's weights outgrow the CPU caches): up to CACHE_BOUND_ROWS rows each timed call runs on
another copy of the weights, COLD_BYTES of float32 copies in all (MAX_COPIES at most); timed on
cache-hot weights, a 3072x576 float32 layer read at ~46 GB/s and beat int8 at one row. The race
is noisy on a shared machine, so two instances may choose differently; every choice is logged.

float32 alone (`quantization="none"`, `dtype="float32"` or `"auto"`) is the exact mode: its
layers are the checkpoint's (no fusion), each packed for oneDNN and checked against F.linear.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from pdcluster.engine.models.fusion import fuse_projections
from pdcluster.engine.models.packed_linear import PackedLinear, pack_linears, shared_weight_ids
from pdcluster.engine.models.quantized_linear import formats_of, quantized

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # input rows the formats are timed at; more: as 64
NUM_TIMINGS = 5  # the best of these counts; each calls every copy once
# The previous bucket's format keeps a bucket unless another is this much faster there.
SWITCH_MARGIN = 0.05
COLD_BYTES = 96 * 1024**2  # float32 bytes of the copies: beyond a server CPU's last-level cache
MAX_COPIES = 32  # a small model's layers stay as cache-hot as its whole step keeps them
# Up to this many rows a call is bound by reading its weight, so the race reads cold copies;
# above, by arithmetic, and two copies suffice.
CACHE_BOUND_ROWS = 16

# A format of a float32 layer: the module multiplying with it, or None where it cannot.
Format = Callable[[nn.Module], nn.Module | None]


class TieredLinear(nn.Module):
    """One linear layer in several formats: an input of N rows goes to the first format whose
    `max_rows` is at least N (the last one's is unbounded). Float32 in and out."""

    def __init__(self, formats: Sequence[nn.Module], max_rows: Sequence[int]) -> None:
        super().__init__()
        self.formats = nn.ModuleList(formats)
        self.max_rows = list(max_rows)
        self.in_features, self.out_features = formats[0].in_features, formats[0].out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = x.numel() // self.in_features
        for limit, layer in zip(self.max_rows, self.formats, strict=True):
            if num_rows <= limit:
                return layer(x)
        raise AssertionError("the last format serves every row count")

    def extra_repr(self) -> str:
        return ", ".join(
            f"{_name(layer)} up to {'any' if limit == sys.maxsize else limit} rows"
            for limit, layer in zip(self.max_rows, self.formats, strict=True)
        )


def _name(layer: nn.Module) -> str:
    if isinstance(layer, PackedLinear):
        return str(layer.dtype).removeprefix("torch.")
    return type(layer).__name__


def float_format(dtype: torch.dtype, keep_dense: bool = False) -> Format:
    """oneDNN's packed layer with its weight in `dtype`; for float32 the plain layer where
    packing is unavailable or fails its check."""

    def make(layer: nn.Module) -> nn.Module | None:
        packed = PackedLinear.from_linear(layer, keep_dense, dtype)
        return layer if packed is None and dtype == torch.float32 else packed

    return make


def _time_s(layers: list[nn.Module], x: torch.Tensor) -> float:
    """Seconds for one call on each of `layers`."""
    start = time.perf_counter()
    for layer in layers:
        layer(x)
    return time.perf_counter() - start


def _dense_copies(layer: nn.Module) -> list[nn.Module]:
    """Float32 layers on copies of `layer`'s weight, enough that their weights come from
    memory (the first is on `layer`'s own weight)."""
    weight = layer.weight.detach().float()  # [out, in]; a packed layer's: unpacked once, here
    count = min(MAX_COPIES, -(-COLD_BYTES // (weight.numel() * 4)))
    copies = []
    for i in range(count):
        dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        dense.requires_grad_(False)
        dense.weight.data = weight if i == 0 else weight.clone()
        if layer.bias is not None:
            dense.bias.data = layer.bias.detach().float()
        copies.append(dense)
    return copies


@torch.no_grad()
def race(formats: Sequence[Format], layer: nn.Module) -> list[int]:
    """For each of ROW_BUCKETS, the index in `formats` of the one timed fastest on `layer`'s
    shape (timings interleaved, each the best of several; weights read from memory up to
    CACHE_BOUND_ROWS rows; the previous bucket's format kept within SWITCH_MARGIN). Every
    format must hold `layer`."""
    dense = _dense_copies(layer)
    copies = [[make(d) for d in dense] for make in formats]
    winners: list[int] = []
    for rows in ROW_BUCKETS:
        x = torch.randn(rows, layer.in_features)
        num_copies = len(dense) if rows <= CACHE_BOUND_ROWS else 2
        for layers in copies:
            layers[0](x)  # warm-up: first-call allocations
        times = [float("inf")] * len(formats)
        for _ in range(NUM_TIMINGS):  # interleaved: a noisy moment hurts every format alike
            for i, layers in enumerate(copies):
                times[i] = min(times[i], _time_s(layers[:num_copies], x))
        fastest = times.index(min(times))
        kept = winners[-1] if winners else fastest  # fewer switches between close formats
        winners.append(kept if times[kept] <= (1 + SWITCH_MARGIN) * times[fastest] else fastest)
    return winners


def tiers(winners: list[int]) -> list[tuple[int, int]]:
    """(format index, max rows) runs of `winners` (one per ROW_BUCKETS), the last unbounded:
    [0, 0, 1, 1] -> [(0, 2), (1, sys.maxsize)]."""
    runs: list[tuple[int, int]] = []
    for rows, winner in zip(ROW_BUCKETS, winners, strict=True):
        if runs and runs[-1][0] == winner:
            runs[-1] = (winner, rows)
        else:
            runs.append((winner, rows))
    runs[-1] = (runs[-1][0], sys.maxsize)
    return runs


def formats_for(
    name: str, quantization: str, weight_dtypes: Sequence[torch.dtype], keep_dense: bool
) -> list[Format]:
    """The formats the linear named `name` may take: `quantization`'s (unless "none"), then a
    packed one per weight dtype."""
    formats: list[Format] = []
    if quantization != "none":
        formats.append(functools.partial(quantized, name, quantization))
    return formats + [float_format(dtype, keep_dense) for dtype in weight_dtypes]


@torch.no_grad()
def tier_linears(model: nn.Module, quantization: str, weight_dtypes: Sequence[torch.dtype]) -> int:
    """Swap each float32 CPU `nn.Linear` of `model` for the formats measured fastest at its
    row counts (a `TieredLinear`, or the one format that won every bucket), in place. Returns
    how many layers serve some rows in a format other than float32."""
    shared = shared_weight_ids(model)
    chosen_for: dict[tuple, list[tuple[int, int]]] = {}  # shape and formats -> tiers
    num_changed = 0
    for name, layer in list(model.named_modules()):
        if type(layer) is not nn.Linear or layer.weight.dtype != torch.float32:
            continue
        if layer.weight.device.type != "cpu":
            continue
        makers = formats_for(name, quantization, weight_dtypes, id(layer.weight) in shared)
        built = [make(layer) for make in makers]
        usable = [i for i, module in enumerate(built) if module is not None]
        if not usable:
            continue
        key = (
            formats_of(name, quantization) if quantization != "none" else None,
            tuple(usable), layer.in_features, layer.out_features, layer.bias is not None,
        )  # fmt: skip
        if key not in chosen_for:
            formats = [makers[i] for i in usable]
            winners = race(formats, layer) if len(formats) > 1 else [0] * len(ROW_BUCKETS)
            chosen_for[key] = [(usable[i], rows) for i, rows in tiers(winners)]
            logger.info("linear %s: %s", name, _describe(chosen_for[key], built))
        chosen = chosen_for[key]
        if len(chosen) == 1:
            module = built[chosen[0][0]]
        else:
            module = TieredLinear([built[i] for i, _ in chosen], [rows for _, rows in chosen])
        if module is not layer:
            model.set_submodule(name, module)
        num_changed += any(not _is_float32(built[i]) for i, _ in chosen)
    return num_changed


def _is_float32(layer: nn.Module) -> bool:
    return type(layer) is nn.Linear or (
        isinstance(layer, PackedLinear) and layer.dtype == torch.float32
    )


def _describe(chosen: list[tuple[int, int]], built: list[nn.Module | None]) -> str:
    layer = built[chosen[0][0]]
    shape = f"[{layer.in_features} -> {layer.out_features}]"
    parts = [f"{_name(built[i])} up to {'any' if r == sys.maxsize else r}" for i, r in chosen]
    return f"{shape} {', '.join(parts)} rows"


def prepare_linears(
    model: nn.Module, quantization: str, weight_dtypes: Sequence[torch.dtype]
) -> int:
    """What a CPU runner does to a loaded float32 model's linear layers, in place. The exact
    mode (no quantization, float32 weights) packs each layer as the checkpoint has it; every
    other mode fuses sibling projections (engine/models/fusion.py), then `tier_linears`.
    Returns how many layers serve some rows in a non-float32 format."""
    if quantization == "none" and tuple(weight_dtypes) == (torch.float32,):
        pack_linears(model)
        return 0
    fuse_projections(model)
    return tier_linears(model, quantization, weight_dtypes)
