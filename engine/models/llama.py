"""Llama-family decoder (Llama, Mistral, Qwen2 layouts) over the paged KV cache.

Parameter names match Hugging Face checkpoints (`model.layers.N.self_attn.q_proj.weight`, ...)
so weights load by name with no mapping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention

ACT_FNS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
}


def get_act_fn(name: str):
    if name not in ACT_FNS:
        raise NotImplementedError(f"activation {name!r} is not supported ({sorted(ACT_FNS)})")
    return ACT_FNS[name]


@dataclass(frozen=True)
class DecoderConfig:
    """The fields of a Hugging Face Llama/Mistral/Qwen2 config.json that shape the model."""

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

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], model_type: str) -> DecoderConfig:
        num_heads = cfg.get("num_attention_heads", 32)
        hidden = cfg.get("hidden_size", 4096)
        attention_bias = bool(cfg.get("attention_bias", False))
        is_qwen2 = model_type == "qwen2"
        rope_theta, rope_scaling = _rope_params(cfg)
        return cls(
            vocab_size=cfg.get("vocab_size", 32000),
            hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size", 11008),
            num_layers=cfg.get("num_hidden_layers", 32),
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            hidden_act=cfg.get("hidden_act", "silu"),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


def _rope_params(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
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


def check_sliding_window(cfg: dict[str, Any], model_type: str, max_len: int) -> None:
    """Sliding-window attention is not implemented; accept it only where it never bites."""
    window = cfg.get("sliding_window")
    if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
        return
    if window is not None and window < max_len:
        raise NotImplementedError(
            f"sliding_window={window} is smaller than the context length {max_len}; sliding-"
            "window attention is not supported (serve with max_model_len <= sliding_window)"
        )


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]; cos, sin [T, 1, hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # statistics in float32 whatever the model dtype
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
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
        self.scale = cfg.head_dim**-0.5
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)  # [T, H, hd]
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, kvh, hd]
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, kvh, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, kv_cache, self.layer_idx, meta, self.scale)  # [T, H, hd]
        return self.o_proj(out.reshape(num_tokens, -1))  # [T, hidden]


class GatedMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        bias = cfg.mlp_bias
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.act = get_act_fn(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 decoder: token ids -> embeddings -> hidden states -> logits."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
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
        cos, sin = self.rotary_emb.cos_sin(positions, inputs_embeds.dtype)  # [T, 1, hd]
        hidden = inputs_embeds
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        return self.model.norm(hidden)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [N, vocab]
