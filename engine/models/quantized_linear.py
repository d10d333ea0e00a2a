"""Weight-only int8 and int4 linear layers for CPU decoding (`quantization="int8"|"int4"`).

A decode step at a few rows reads every weight once, so its matmuls cost what their weights
weigh. torch's weight-only kernels multiply bfloat16 activations by the quantized weights and
keep activations at bf16's relative precision (quantizing them to 8 bits per row, as fbgemm's
dynamic linear does, measured +13% perplexity on SmolLM2; int8 weights, -0.1%):
- `Int8Linear`: int8 with one scale per output row (symmetric, per channel;
  `torch._weight_int8pack_mm`): a quarter of float32's bytes.
- `Int4Linear`: 4 bits with a scale and an offset per GROUP_SIZE inputs of each row
  (asymmetric, from each group's min and max; `torch._weight_int4pack_mm_for_cpu`): an eighth
  of float32's bytes, plus the groups' scales. A GGUF's Q4_1 blocks are this very grid (32
  weights, `d * q + m`), so a Q4_1 checkpoint's weights come back as the file holds them, bar
  bf16's rounding of each group's scale and offset.
- `Int8DotLinear` and `Int4DotLinear`, preferred where the engine's kernels run
  (AVX512-VNNI, or AVX2 with FMA): the same grids (int4's with float16 scales and offsets, a Q4_1 block's own),
  times activations quantized per group of 32 rather than per row, as llama.cpp does, by
  integer dot products, in one call with float32 in and out (faster than torch's kernels at
  one to eight rows, with quality as theirs). Whole decoder layers run on
  `Int4DotLinear` in one call (engine/models/decode_kernel.py).

Those kernels are fast at one to a few rows and slow on many (they dequantize per row block),
so a quantized layer serves only the row counts it was measured fastest at, beside a float
format for the rest (engine/models/tiered_linear.py). Results are not exact:
tests/test_quantization.py bounds greedy agreement, top-logprob closeness and perplexity
against float32. float32 (`quantization="none"`) stays the exact mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.kernels import cpu_kernels

GROUP_SIZE = 32  # int4: inputs sharing one scale and offset (GGUF's Q4_0/Q4_1 block)


class WeightOnlyLinear(nn.Module):
    """`y ~= x @ W.T + b` with W quantized: float32 in and out, bf16 products. Build with
    `from_layer`; subclasses say how a weight is quantized and multiplied."""

    # Largest allowed |quantized - float32| relative to the largest |float32| output at load,
    # on random inputs: catches a kernel that misreads its layout, not rounding.
    check_tol: float
    check_rows = 16  # rows of that check

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, layer: nn.Module) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.bias = layer.bias  # float32, added after the product

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
        """The quantized twin of float32 `layer`, or None when the kernel is missing, cannot
        run it, or its results stray from the layer's."""
        if not cls.available():
            return None
        weight = layer.weight.detach().float()  # [out, in]
        quantized = cls.quantize(weight)
        if quantized is None:
            return None
        twin = cls(*quantized, layer)
        x = torch.randn(cls.check_rows, layer.in_features, generator=torch.Generator())
        try:
            got = twin(x)
        except RuntimeError:
            return None
        want = F.linear(x, weight, layer.bias)
        return twin if (got - want).abs().max() <= cls.check_tol * want.abs().max() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [N, in]
        out = self.matmul(rows.bfloat16()).float()  # [N, out]
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)  # [..., out]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _int8_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] as q in -127..127 ([out, in], float) times one float32 scale per
    output row ([out]; symmetric)."""
    scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # [out]
    return torch.round(weight / scales[:, None]).clamp(-127, 127), scales


def _int4_grid(
    weight: torch.Tensor, stored: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group of GROUP_SIZE inputs of weight [out, in] on 16 levels from its min (q = 0)
    to its max (q = 15): q [out, groups, GROUP_SIZE] (float), and per group [out, groups] the
    step and the min as `stored` holds them (in float32)."""
    out_features, in_features = weight.shape
    groups = weight.view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [out, groups]
    step = ((high - low) / 15).to(stored).float().clamp(min=1e-12)
    low = low.to(stored).float()
    return torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15), step, low


class Int8Linear(WeightOnlyLinear):
    """int8 weights, one bf16 scale per output row (symmetric)."""

    check_tol = 0.03  # per-channel int8 with bf16 activations stays within ~1% here

    @staticmethod
    def available() -> bool:
        return hasattr(torch, "_weight_int8pack_mm")

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scales = _int8_grid(weight)
        return q.to(torch.int8), scales.bfloat16()

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
        q, scale, low = _int4_grid(weight, torch.float32)
        packed = torch._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).view(out_features, in_features), 1
        )
        offset = low + 8 * scale  # the kernel centres q on 8
        scales_and_offsets = torch.stack([scale.t(), offset.t()], dim=-1)  # [groups, out, 2]
        return packed, scales_and_offsets.contiguous().bfloat16()

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(rows, self.qweight, GROUP_SIZE, self.scales)


class DotLinear(WeightOnlyLinear):
    """A format multiplied by the engine's kernels (engine/kernels/dot_linear.cpp): the
    activations quantized to int8 per group of 32 as llama.cpp's are, integer dot products by
    AVX512-VNNI or AVX2, float32 in and out in one call."""

    @staticmethod
    def available() -> bool:
        kernels = cpu_kernels()
        return kernels is not None and kernels.dot_linear_supported()

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` [N, in] float32 times the weight, plus the bias: [N, out] float32."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernel(x.reshape(-1, self.in_features))  # [N, out]
        return out.view(*x.shape[:-1], self.out_features)  # [..., out]


class Int8DotLinear(DotLinear):
    """`Int8Linear`'s grid (int8, a scale per output row), stored as q + 128 with a float32
    scale, multiplied by int8 activations."""

    check_tol = 0.03  # as Int8Linear

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if weight.shape[1] % (2 * GROUP_SIZE):
            return None
        q, scales = _int8_grid(weight)
        return (q + 128).to(torch.uint8), scales

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdcluster.int8_linear(rows, self.qweight, self.scales, self.bias)


INT4_BLOCK_GROUPS = 8  # groups whose weights one step of the int4 kernel reads side by side


def _pack_int4_blocks(q: torch.Tensor) -> torch.Tensor:
    """q [out, groups, 32] (0..15) packed as engine/kernels/dot_linear.cpp's int4_linear reads
    it: [out, in / 2] bytes, per row blocks of INT4_BLOCK_GROUPS groups (the last may be
    shorter), each 4 chunks j of 4 bytes per group, whose low nibbles hold its q[8j .. 8j + 3]
    and high nibbles its q[8j + 4 .. 8j + 7]."""
    out_features, num_groups, _ = q.shape
    num_blocks = -(-num_groups // INT4_BLOCK_GROUPS)
    padded = q.new_zeros(out_features, num_blocks * INT4_BLOCK_GROUPS, GROUP_SIZE)
    padded[:, :num_groups] = q
    # [out, block, lane, j, nibble, byte]: position 8j + 4 * nibble + byte of the lane's group
    parts = padded.view(out_features, num_blocks, INT4_BLOCK_GROUPS, 4, 2, 4)
    nibbles = parts[..., 0, :] | (parts[..., 1, :] << 4)  # [out, block, lane, j, 4]
    chunks = nibbles.transpose(2, 3)  # [out, block, j, lane, 4]
    full, tail = divmod(num_groups, INT4_BLOCK_GROUPS)
    packed = [chunks[:, :full].reshape(out_features, -1)]
    if tail:  # the last block holds its groups only
        packed.append(chunks[:, full, :, :tail].reshape(out_features, -1))
    return torch.cat(packed, dim=1).contiguous()


class Int4DotLinear(DotLinear):
    """`Int4Linear`'s grid with float16 scales and minimums (a GGUF Q4_1 block's own: its
    weights come back exactly), multiplied by int8 activations; whole decoder layers run on
    it in one call (engine/models/decode_kernel.py)."""

    check_tol = 0.15  # as Int4Linear

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if weight.shape[1] % GROUP_SIZE:
            return None
        q, step, low = _int4_grid(weight, torch.float16)
        scales = torch.stack([step.half(), low.half()], dim=1)  # [out, 2, groups]: d, then m
        return _pack_int4_blocks(q.to(torch.uint8)), scales.contiguous()

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdcluster.int4_linear(rows, self.qweight, self.scales, self.bias)


# quantization name -> its layers, the preferred first: a layer takes the first that holds it
FORMATS: dict[str, tuple[type[WeightOnlyLinear], ...]] = {
    "int8": (Int8DotLinear, Int8Linear),
    "int4": (Int4DotLinear, Int4Linear),
}
# The output head (`...lm_head`) keeps 8 bits in every mode, as GPTQ and AWQ leave it unquantized
# and llama.cpp's Q4 files store it at 6-8 bits: its errors land on the logits directly (int4
# there took SmolLM2's greedy agreement with float32 from ~60 to ~40 of 64 tokens).
HEAD, HEAD_FORMATS = "lm_head", FORMATS["int8"]


def formats_of(name: str, quantization: str) -> tuple[type[WeightOnlyLinear], ...]:
    """The layers that may quantize the linear named `name` in mode `quantization`, the
    preferred first."""
    return HEAD_FORMATS if name.rsplit(".", 1)[-1] == HEAD else FORMATS[quantization]


def quantized(name: str, quantization: str, layer: nn.Module) -> WeightOnlyLinear | None:
    """`layer` (named `name`) quantized by the first of its mode's formats that can hold it
    on this machine, or None where none can."""
    for kind in formats_of(name, quantization):
        twin = kind.from_layer(layer)
        if twin is not None:
            return twin
    return None
