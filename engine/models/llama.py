"""Llama-family decoder over the paged KV cache: Llama, Mistral, Qwen2, Qwen3 (per-head q/k
RMSNorm), and with a sparse MoE block Mixtral and Qwen3-MoE. Gemma builds on it (gemma.py).

Parameter names match Hugging Face checkpoints (`model.layers.N.self_attn.q_proj.weight`, ...)
so weights load by name with no mapping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.attention import AttentionMetadata, paged_attention
from pdcluster.engine.models.mlp import GatedMLP
from pdcluster.engine.models.moe import MoeConfig, SparseMoeBlock

if TYPE_CHECKING:
    from pdcluster.engine.models.decode_kernel import DecodeKernel

QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
# Model types whose `sliding_window` applies only with `use_sliding_window`.
OPT_IN_WINDOW_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class DecoderConfig:
    """The fields of a Hugging Face decoder config.json that shape the model. The fields with
    defaults are off for plain Llama; Gemma sets its own in `gemma.gemma_config`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    layer_windows: tuple[int | None, ...]  # per layer: its sliding window, None = full
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    moe: MoeConfig | None = None
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight) (Gemma)
    query_pre_attn_scalar: float | None = None  # softmax scale = this ** -0.5 (default head_dim)
    attn_softcap: float | None = None  # attention scores soft-capped at this (Gemma 2)
    final_softcap: float | None = None  # logits soft-capped at this (Gemma 2)
    embed_scale: float = 1.0  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    local_rope_theta: float | None = None  # RoPE base of sliding layers (Gemma 3), else shared

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], model_type: str) -> DecoderConfig:
        num_heads = cfg.get("num_attention_heads", 32)
        hidden = cfg.get("hidden_size", 4096)
        attention_bias = bool(cfg.get("attention_bias", False))
        is_qwen2 = model_type == "qwen2"
        rope_theta, rope_scaling = rope_params(cfg)
        num_layers = cfg.get("num_hidden_layers", 32)
        return cls(
            vocab_size=cfg.get("vocab_size", 32000),
            hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size", 11008),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            hidden_act=cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu",
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            layer_windows=layer_windows(cfg, model_type, num_layers),
            qk_norm=model_type in QK_NORM_MODEL_TYPES,
            moe=MoeConfig.from_hf(cfg, model_type, num_layers),
        )

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


def layer_windows(
    cfg: dict[str, Any], model_type: str, num_layers: int, every_nth_full: int | None = None
) -> tuple[int | None, ...]:
    """Each layer's sliding window (None = full attention): from `layer_types` when the config
    lists them, else every layer (Mistral, Mixtral), else all but every `every_nth_full`-th
    (Gemma's default pattern), or Qwen2's layers from `max_window_layers` on."""
    window = cfg.get("sliding_window")
    if window is None or (
        model_type in OPT_IN_WINDOW_MODEL_TYPES and not cfg.get("use_sliding_window", False)
    ):
        return (None,) * num_layers
    if cfg.get("layer_types"):
        return tuple(window if t == "sliding_attention" else None for t in cfg["layer_types"])
    if every_nth_full is not None:
        return tuple(window if (i + 1) % every_nth_full else None for i in range(num_layers))
    if model_type in OPT_IN_WINDOW_MODEL_TYPES:
        first = cfg.get("max_window_layers", num_layers)
        return tuple(window if i >= first else None for i in range(num_layers))
    return (window,) * num_layers


def rope_params(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either `rope_parameters` (transformers>=5) or the
    older `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = {**legacy, **params}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    return theta, {**scaling, "rope_type": rope_type}


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, on CPU whatever the default device."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise NotImplementedError(f"rope_scaling type {rope_type!r} is not supported (llama3, linear)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Long wavelengths slowed by `factor`, short ones kept, a smooth blend in between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_len / high, inv_freq, out)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE. inv_freq is a plain CPU tensor (not a parameter or buffer), so a model
    built on the meta device needs no re-initialisation; copies are cached per device."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self._inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [T] -> cos, sin [T, 1, head_dim] in `dtype` (angles in float32)."""
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on[positions.device] = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class RMSNorm(nn.Module):
    """x / rms(x) scaled by `weight`, or by `1 + weight` with `unit_offset` (Gemma, which also
    scales in float32 before casting back)."""

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32 and not self.unit_offset:
            # torch's fused norm: bit for bit the float32 ops below, in one call
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()  # statistics in float32 whatever the model dtype
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


class DecoderAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.scale = cfg.attn_scale
        self.sliding_window = cfg.layer_windows[layer_idx]
        self.softcap = cfg.attn_softcap
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        # q, k and v in one layer when `fusion.fuse_projections` built one (then the three
        # are None): one matmul over the input instead of three.
        self.qkv_proj: nn.Module | None = None
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_unit_offset)

    @property
    def qkv_sizes(self) -> tuple[int, int, int]:
        """Output features of q, k and v (this rank's heads when sharded)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return q_size, kv_size, kv_size

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, hd]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, kvh, hd]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, kvh, hd]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = paged_attention(
            q,
            k,
            v,
            kv_cache,
            self.layer_idx,
            meta,
            self.scale,
            self.sliding_window,
            self.softcap,
            rope=(cos, sin),
        )  # [T, H, hd]: q and k rotated by RoPE first
        return self.o_proj(out.reshape(num_tokens, -1))  # [T, hidden]


def make_mlp(cfg: DecoderConfig, layer_idx: int) -> nn.Module:
    """The layer's feed-forward block: a sparse MoE where the config puts one, else dense."""
    if cfg.moe is not None and cfg.moe.sparse_layers[layer_idx]:
        return SparseMoeBlock(cfg.hidden_size, cfg.moe, cfg.hidden_act)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.self_attn = DecoderAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset
        )
        self.mlp = make_mlp(cfg, layer_idx)
        # The whole layer as one kernel call on the decode steps it serves, where
        # `decode_kernel.attach_decode_kernels` gave it one (4-bit weights on CPU).
        self.decode_kernel: DecodeKernel | None = None

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        if self.decode_kernel is not None and self.decode_kernel.takes(x, kv_cache, meta):
            return self.decode_kernel(x, cos, sin, kv_cache, meta)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_cls: type[DecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)


class LlamaForCausalLM(nn.Module):
    """Llama-family decoder: token ids -> embeddings -> hidden states -> logits."""

    layer_cls: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, self.layer_cls)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.local_rotary_emb = None  # sliding layers' own RoPE, where their base differs
        if cfg.local_rope_theta is not None:
            self.local_rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.local_rope_theta, None)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)  # [T, hidden]

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        rope = self.rotary_emb.cos_sin(positions, inputs_embeds.dtype)  # cos, sin [T, 1, hd]
        local_rope = rope
        if self.local_rotary_emb is not None:
            local_rope = self.local_rotary_emb.cos_sin(positions, inputs_embeds.dtype)
        hidden = inputs_embeds
        for layer in self.model.layers:
            cos, sin = rope if layer.self_attn.sliding_window is None else local_rope
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        return self.model.norm(hidden)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [N, vocab]
