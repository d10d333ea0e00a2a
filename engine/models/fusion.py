"""Sibling projections that read the same input, fused into one layer: a decoder attention's
q, k and v (`qkv_proj`), a gated MLP's gate and up (`gate_up_proj`). One matmul over the
concatenated weights replaces two or three, which at decode batch sizes saves the calls' fixed
costs and reads the input once. Used by the non-exact modes only (a quantization, or weights in
bf16): float32 keeps the checkpoint's separate layers, the ones the token-exact tests check.
"""

from __future__ import annotations

import torch
from torch import nn

from pdcluster.engine.models.llama import DecoderAttention
from pdcluster.engine.models.mlp import GatedMLP

# module type -> (the fused layer's attribute, the siblings it replaces, in output order)
FUSIBLE: dict[type[nn.Module], tuple[str, tuple[str, ...]]] = {
    DecoderAttention: ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    GatedMLP: ("gate_up_proj", ("gate_proj", "up_proj")),
}


@torch.no_grad()
def fused_linear(parts: list[nn.Module]) -> nn.Linear:
    """One float32 layer computing every part's output, concatenated in order."""
    weight = torch.cat([p.weight.detach().float() for p in parts])  # [sum(out), in]
    has_bias = parts[0].bias is not None
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device=weight.device)
    linear.weight.copy_(weight)
    if has_bias:
        linear.bias.copy_(torch.cat([p.bias.detach().float() for p in parts]))
    return linear.requires_grad_(False)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every FUSIBLE group of float32 siblings of `model` in place (the siblings become
    None). Returns how many groups were fused."""
    num_fused = 0
    for module in list(model.modules()):
        spec = next((s for kind, s in FUSIBLE.items() if isinstance(module, kind)), None)
        if spec is None:
            continue
        fused_name, part_names = spec
        parts = [getattr(module, name) for name in part_names]
        if (
            any(p is None or p.weight.dtype != torch.float32 for p in parts)
            or len({p.bias is None for p in parts}) > 1
        ):
            continue
        setattr(module, fused_name, fused_linear(parts))
        for name in part_names:
            setattr(module, name, None)
        num_fused += 1
    return num_fused
