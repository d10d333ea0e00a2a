"""Whole decoder layers as one CPU kernel call on decode steps of a few sequences.

At one to a few rows a layer's arithmetic is small: with 4-bit weights a SmolLM2 layer's
matmuls take ~0.3 ms, while calling its ~30 torch operators and ~10 modules from Python costs
about as much again. `engine/kernels/decode_layer.cpp` runs the layer as `DecoderLayer` does
(norms, the fused q/k/v and gate/up projections, RoPE with the KV write, paged decode
attention, SiLU, the residual adds) in one call, on the layers' `Int4DotLinear` weights.

`attach_decode_kernels` gives each layer it can run a `DecodeKernel`, which the layer calls
on decode-only steps of at most `max_rows` sequences: the rows up to which every one of its
projections was measured fastest in `Int4DotLinear` (tiered_linear.py). Any other step, and any
layer with a part the kernel lacks (another activation, soft-capping, Gemma's norms, tensor
parallel hooks), runs the layer's own modules.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.kernels import cpu_kernels
from pdcluster.engine.models.llama import DecoderLayer, RMSNorm
from pdcluster.engine.models.mlp import ACT_FNS, GatedMLP
from pdcluster.engine.models.quantized_linear import Int4DotLinear
from pdcluster.engine.models.tiered_linear import TieredLinear


class DecodeKernel:
    """One layer's weights as the kernel takes them, and the rows it serves."""

    def __init__(self, layer: DecoderLayer, max_rows: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o = _int4(attn.qkv_proj), _int4(attn.o_proj)
        gate_up, down = _int4(mlp.gate_up_proj), _int4(mlp.down_proj)
        q_norm = attn.q_norm.weight if attn.qk_norm else None
        k_norm = attn.k_norm.weight if attn.qk_norm else None
        self.max_rows = max_rows
        self.layer_idx = attn.layer_idx
        self.weights = (
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            qkv.qweight, qkv.scales, qkv.bias, q_norm, k_norm,
            o.qweight, o.scales, o.bias,
            gate_up.qweight, gate_up.scales, gate_up.bias,
            down.qweight, down.scales, down.bias,
        )  # fmt: skip
        self.shape = (attn.num_heads, attn.num_kv_heads)
        self.attention = (attn.scale, attn.sliding_window or 0, layer.input_layernorm.eps)

    def takes(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step is the kernel's: decodes only, few enough, float32 throughout."""
        decodes = meta.decodes
        return (
            decodes is not None
            and decodes.token_indices is None
            and x.shape[0] <= self.max_rows
            and x.dtype == kv_cache.dtype == torch.float32
            and kv_cache.is_contiguous()
        )

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        decodes = meta.decodes
        scale, window, eps = self.attention
        return torch.ops.pdcluster.decode_layer(
            x.contiguous(), *self.weights, cos, sin, kv_cache, self.layer_idx,
            meta.slot_block_ids, meta.slot_offsets, decodes.block_tables, decodes.seq_lens,
            *self.shape, scale, window, eps,
        )  # fmt: skip


def _int4(layer: nn.Module | None) -> Int4DotLinear | None:
    """The `Int4DotLinear` serving `layer`'s fewest rows, or None."""
    if isinstance(layer, TieredLinear):
        layer = layer.formats[0]
    return layer if isinstance(layer, Int4DotLinear) else None


def _int4_rows(layer: nn.Module | None) -> int:
    """Rows up to which `layer` multiplies in `Int4DotLinear` (0: none)."""
    if isinstance(layer, TieredLinear):
        return layer.max_rows[0] if _int4(layer) is not None else 0
    return sys.maxsize if _int4(layer) is not None else 0  # one format: every row count


def _plain_norm(norm: RMSNorm, eps: float) -> bool:
    return not norm.unit_offset and norm.eps == eps and norm.weight.dtype == torch.float32


def decode_kernel_for(layer: nn.Module) -> DecodeKernel | None:
    """`layer`'s kernel, or None where the kernel cannot run it as its modules do."""
    if type(layer) is not DecoderLayer or type(layer.mlp) is not GatedMLP:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    eps = layer.input_layernorm.eps
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if attn.qk_norm:
        norms += [attn.q_norm, attn.k_norm]
    if (
        attn.softcap is not None
        or mlp.act is not ACT_FNS["silu"]
        or not all(_plain_norm(norm, eps) for norm in norms)
        or any(m._forward_hooks or m._forward_pre_hooks for m in (layer, attn, mlp))
    ):
        return None
    max_rows = min(
        _int4_rows(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    )
    return DecodeKernel(layer, max_rows) if max_rows > 0 else None


def attach_decode_kernels(model: nn.Module) -> int:
    """Give every layer of `model` the kernel can run its `decode_kernel`. Returns how many."""
    if cpu_kernels() is None:
        return 0
    num_attached = 0
    for layer in model.modules():
        if isinstance(layer, DecoderLayer):
            layer.decode_kernel = decode_kernel_for(layer)
            num_attached += layer.decode_kernel is not None
    return num_attached
