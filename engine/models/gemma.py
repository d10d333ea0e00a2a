"""Gemma 2 and Gemma 3 (text) decoders, on the Llama-family skeleton of llama.py.

What differs from Llama: RMSNorm scales by (1 + weight); every layer norms the attention and
MLP outputs too (post_attention_layernorm, pre/post_feedforward_layernorm); embeddings are
multiplied by sqrt(hidden_size); the softmax scale is query_pre_attn_scalar ** -0.5; sliding-
window layers alternate with full ones. Gemma 2 soft-caps attention scores and final logits;
Gemma 3 norms q and k per head and gives its sliding layers a RoPE base of their own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.models.llama import (
    DecoderConfig,
    DecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
    layer_windows,
    rope_params,
)

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
# Without `layer_types` in config.json, all but every Nth layer use the sliding window.
_EVERY_NTH_FULL = {"gemma2": 2, "gemma3_text": 6}


def gemma_config(cfg: dict[str, Any], model_type: str) -> DecoderConfig:
    """DecoderConfig of a Gemma 2 / Gemma 3 text config.json."""
    base = DecoderConfig.from_hf(cfg, model_type)
    every_nth = cfg.get("sliding_window_pattern") or _EVERY_NTH_FULL[model_type]
    rope_theta, rope_scaling, local_theta = base.rope_theta, base.rope_scaling, None
    if model_type == "gemma3_text":
        by_layer_type = cfg.get("rope_parameters") or {}
        if "full_attention" in by_layer_type:  # transformers>=5: one RoPE per layer type
            rope_theta, rope_scaling = rope_params(
                {"rope_parameters": by_layer_type["full_attention"]}
            )
            local_theta = by_layer_type.get("sliding_attention", {}).get("rope_theta")
        local_theta = float(local_theta or cfg.get("rope_local_base_freq", 10000.0))
    return dataclasses.replace(
        base,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        layer_windows=layer_windows(cfg, model_type, base.num_layers, every_nth),
        qk_norm=model_type == "gemma3_text",
        norm_unit_offset=True,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        attn_softcap=cfg.get("attn_logit_softcapping"),
        final_softcap=cfg.get("final_logit_softcapping"),
        embed_scale=base.hidden_size**0.5,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        local_rope_theta=local_theta,
    )


class GemmaDecoderLayer(DecoderLayer):
    """Sandwich norms: each sub-block's output is normed before it joins the residual."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, True)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, True)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp)


class GemmaForCausalLM(LlamaForCausalLM):
    layer_cls = GemmaDecoderLayer

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.model.embed_tokens(input_ids)  # [T, hidden]
        # The scale is rounded to the model dtype first, as transformers does.
        return embeds * torch.tensor(self.config.embed_scale, dtype=embeds.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)  # [N, vocab] float32
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
