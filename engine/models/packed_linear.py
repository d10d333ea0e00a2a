"""Linear layers whose float32 CPU weights are prepacked once for oneDNN.

`F.linear` hands MKL a `[out, in]` row-major weight, which MKL repacks into its blocked layout
on every call; at decode batch sizes (a few to a few dozen rows) that repacking reads and
writes the whole weight again, so a decode step costs ~1.4x its matmuls. Packing each weight
once at load (`mkldnn._reorder_linear_weight`) and multiplying with `mkldnn._linear_pointwise`
removes that pass.

Both ops are private torch ops: they are used only when they exist, and each packed layer is
checked at load against `F.linear` on random inputs; a layer that fails keeps `F.linear`.
The packed copy replaces the dense weight (memory is not doubled) unless another module
shares that weight (a tied `lm_head` keeps the embedding's). `state_dict()` and `.weight`
still give the dense tensor under the checkpoint's names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BATCH_HINT = 16  # rows the packed layout is tuned for: a typical decode batch
CHECK_ROWS = (1, BATCH_HINT)  # input rows checked against F.linear at load
# Largest allowed |packed - F.linear| relative to the largest |F.linear| output: float32
# results that differ only in summation order stay ~1e-6 apart at these sizes.
CHECK_TOL = 1e-5


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


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W held in oneDNN's packed layout. Build with `from_linear`."""

    def __init__(
        self, packed: torch.Tensor, bias: nn.Parameter | None, dense: torch.Tensor | None
    ) -> None:
        super().__init__()
        # Opaque oneDNN tensor [out, in]: a buffer so that memory accounting (module_bytes)
        # sees it, left out of state_dict (which gives the dense weight, see below).
        self.register_buffer("packed", packed, persistent=False)
        self.in_features, self.out_features = packed.shape[1], packed.shape[0]
        self.bias = bias
        # Kept only when another module owns it (its parameter there, a plain tensor here).
        self._dense = dense

    @classmethod
    def from_linear(cls, linear: nn.Linear, keep_dense: bool) -> PackedLinear | None:
        """The packed twin of `linear`, or None if its results differ from F.linear's."""
        weight, bias = linear.weight, linear.bias
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        except RuntimeError:
            return None
        layer = cls(packed, bias, weight.data if keep_dense else None)
        return layer if layer._matches(weight, bias) else None

    @torch.no_grad()
    def _matches(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        gen = torch.Generator().manual_seed(0)
        for rows in CHECK_ROWS:
            x = torch.randn(rows, self.in_features, generator=gen)  # [rows, in]
            ref = F.linear(x, weight, bias)  # [rows, out]
            if not (self(x) - ref).abs().max() <= CHECK_TOL * ref.abs().max():
                return False
        return True

    @property
    def weight(self) -> torch.Tensor:
        """The dense [out, in] weight (a fresh copy unless it is shared)."""
        return self._dense if self._dense is not None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[prefix + "weight"] = self.weight.detach()  # before the bias, as nn.Linear
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(model: nn.Module) -> int:
    """Swap every float32 CPU `nn.Linear` of `model` for a checked `PackedLinear`, in place.
    Returns how many were packed (0 when the ops are missing)."""
    if not packing_available():
        return 0
    linears = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
    ]
    linear_weights = {id(m.weight) for _, m in linears}
    shared = {  # weights another module also reads (a tied lm_head and the embedding)
        id(p) for m in model.modules() if type(m) is not nn.Linear for p in m.parameters(False)
    } & linear_weights
    num_packed = 0
    for name, linear in linears:
        packed = PackedLinear.from_linear(linear, keep_dense=id(linear.weight) in shared)
        if packed is not None:
            model.set_submodule(name, packed)
            num_packed += 1
    return num_packed
