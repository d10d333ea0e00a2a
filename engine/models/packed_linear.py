"""Linear layers whose CPU weights are prepacked once for oneDNN, in float32 or bfloat16.

`F.linear` hands MKL a `[out, in]` row-major weight, which MKL repacks into its blocked layout
on every call; at decode batch sizes (a few to a few dozen rows) that repacking reads and
writes the whole weight again, so a decode step costs ~1.4x its matmuls. Packing each weight
once at load (`mkldnn._reorder_linear_weight`) and multiplying with `mkldnn._linear_pointwise`
removes that pass.

A bfloat16 layer holds its weight in bf16 (half the bytes) and multiplies bf16 copies of its
float32 inputs, accumulating in float32 inside oneDNN; it takes and gives float32, and adds its
bias in float32, so the rest of the model (norms, attention, the KV cache) stays float32. On a
CPU with native bf16 dot products (AVX512-BF16, AMX) it is faster than float32 from one row to
prefill chunks; without them it is slower, and only `dtype="bfloat16"`
asks for it there.

Both ops are private torch ops: they are used only when they exist, and each packed layer is
checked at load against `F.linear` on random inputs; a layer that fails keeps `F.linear`.
The packed copy replaces the dense weight (memory is not doubled) unless another module
shares that weight (a tied `lm_head` keeps the embedding's). `state_dict()` and `.weight`
still give the dense float32 tensor under the checkpoint's names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BATCH_HINT = 16  # rows the packed layout is tuned for: a typical decode batch
CHECK_ROWS = (1, BATCH_HINT)  # input rows checked against F.linear at load
# Largest allowed |packed - reference| relative to the largest |reference| output, per weight
# dtype. float32 results that differ only in summation order stay ~1e-6 apart at these sizes;
# bf16 is checked against F.linear over the same bf16-rounded inputs and weights, so only its
# bf16 output rounding (2^-9 relative) and summation order remain.
CHECK_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
WEIGHT_DTYPES = tuple(CHECK_TOL)  # the dtypes a packed weight can have


def packing_available() -> bool:
    """Whether this torch build has oneDNN and both private ops."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018 (lookup raises when missing)
        torch.ops.mkldnn._linear_pointwise  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def native_bf16() -> bool:
    """Whether oneDNN multiplies bf16 natively on this CPU (else it refuses or emulates)."""
    return packing_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W held in oneDNN's packed layout, in float32 or bfloat16; float32
    in and out. Build with `from_linear`."""

    def __init__(
        self, packed: torch.Tensor, bias: nn.Parameter | None, dense: torch.Tensor | None
    ) -> None:
        super().__init__()
        # Opaque oneDNN tensor [out, in]: a buffer so that memory accounting (module_bytes)
        # sees it, left out of state_dict (which gives the dense weight, see below).
        self.register_buffer("packed", packed, persistent=False)
        self.in_features, self.out_features = packed.shape[1], packed.shape[0]
        self.bias = bias  # float32, added after the product
        # Kept only when another module owns it (its parameter there, a plain tensor here).
        self._dense = dense

    @classmethod
    def from_linear(
        cls, linear: nn.Module, keep_dense: bool, dtype: torch.dtype = torch.float32
    ) -> PackedLinear | None:
        """The packed twin of float32 `linear` with its weight in `dtype`, or None if oneDNN
        cannot pack it or its results differ from F.linear's."""
        weight, bias = linear.weight.detach(), linear.bias
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), BATCH_HINT)
        except RuntimeError:
            return None
        layer = cls(packed, bias, weight if keep_dense else None)
        return layer if layer._matches(weight, bias) else None

    @property
    def dtype(self) -> torch.dtype:
        """The weight's dtype (the product's inputs are rounded to it)."""
        return self.packed.dtype

    @torch.no_grad()
    def _matches(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        gen = torch.Generator().manual_seed(0)
        rounded = weight.to(self.dtype).float()
        for rows in CHECK_ROWS:
            x = torch.randn(rows, self.in_features, generator=gen)  # [rows, in]
            ref = F.linear(x.to(self.dtype).float(), rounded, bias)  # [rows, out]
            if not (self(x) - ref).abs().max() <= CHECK_TOL[self.dtype] * ref.abs().max():
                return False
        return True

    @property
    def weight(self) -> torch.Tensor:
        """The dense float32 [out, in] weight (a fresh copy unless it is shared)."""
        return self._dense if self._dense is not None else self.packed.to_dense().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, None, "none", [], "")
        y = y.to(x.dtype)  # [..., out] float32
        return y if self.bias is None else y.add_(self.bias)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[prefix + "weight"] = self.weight.detach()  # before the bias, as nn.Linear
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def extra_repr(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, packed {name}"


def shared_weight_ids(model: nn.Module) -> set[int]:
    """ids of the linear weights another kind of module also reads (a tied lm_head and the
    embedding): their dense tensor must stay."""
    return {id(p) for m in model.modules() if type(m) is not nn.Linear for p in m.parameters(False)}


def pack_linears(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Swap every float32 CPU `nn.Linear` of `model` for a checked `PackedLinear` with its
    weight in `dtype`, in place. Returns how many were packed (0 when the ops are missing)."""
    if not packing_available():
        return 0
    linears = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
    ]
    shared = shared_weight_ids(model)
    num_packed = 0
    for name, linear in linears:
        packed = PackedLinear.from_linear(linear, id(linear.weight) in shared, dtype)
        if packed is not None:
            model.set_submodule(name, packed)
            num_packed += 1
    return num_packed
