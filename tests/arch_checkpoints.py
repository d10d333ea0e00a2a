"""Tiny random checkpoints of the Qwen3, Qwen3-MoE, Mixtral, Gemma 2 and Gemma 3 layouts,
built offline by transformers itself (config class -> random weights -> save_pretrained), with
a preset's tokenizer copied in so that the whole engine (`engine.LLM`) can serve them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SLIDING_WINDOW = 8  # far below the tests' prompt lengths, so the window bites

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.1,  # larger than the default, so that logits are far from ties
    bos_token_id=1,
    eos_token_id=2,
)


def _qwen3(vocab: int, **overrides):
    return transformers.Qwen3Config(
        **{**_COMMON, "vocab_size": vocab, "num_hidden_layers": 2, **overrides}
    )


def _qwen3_moe(vocab: int, **overrides):
    moe = dict(
        num_hidden_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],  # one dense layer among the sparse ones
    )
    return transformers.Qwen3MoeConfig(**{**_COMMON, "vocab_size": vocab, **moe, **overrides})


def _mixtral(vocab: int, **overrides):
    moe = dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    return transformers.MixtralConfig(**{**_COMMON, "vocab_size": vocab, **moe, **overrides})


def _gemma2(vocab: int, **overrides):
    gemma = dict(
        num_hidden_layers=4,
        sliding_window=SLIDING_WINDOW,
        query_pre_attn_scalar=24,  # not head_dim, so that the scale is checked
        attn_logit_softcapping=2.0,  # low enough to bend these small scores
        final_logit_softcapping=3.0,
    )
    return transformers.Gemma2Config(**{**_COMMON, "vocab_size": vocab, **gemma, **overrides})


def _gemma3(vocab: int, **overrides):
    gemma = dict(
        num_hidden_layers=4,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=24,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    return transformers.Gemma3TextConfig(**{**_COMMON, "vocab_size": vocab, **gemma, **overrides})


def _qwen2(vocab: int, **overrides):
    return transformers.Qwen2Config(
        **{**_COMMON, "vocab_size": vocab, "num_hidden_layers": 2, **overrides}
    )


# Qwen2 is served by the engine tests of its preset; here it is only a GGUF source.
GGUF_SOURCES = {"qwen2": (_qwen2, transformers.Qwen2ForCausalLM)}
CONFIGS = {
    "qwen3": (_qwen3, transformers.Qwen3ForCausalLM),
    "qwen3_moe": (_qwen3_moe, transformers.Qwen3MoeForCausalLM),
    "mixtral": (_mixtral, transformers.MixtralForCausalLM),
    "gemma2": (_gemma2, transformers.Gemma2ForCausalLM),
    "gemma3_text": (_gemma3, transformers.Gemma3ForCausalLM),
}


def random_model(model_type: str, vocab: int, seed: int = 0, **overrides) -> torch.nn.Module:
    """transformers' model of `model_type` with random weights, its norms (which initialise
    to a constant) and routers (zeros in Qwen3-MoE) drawn too, so that every weight counts."""
    make_config, model_cls = {**CONFIGS, **GGUF_SOURCES}[model_type]
    torch.manual_seed(seed)
    model = model_cls(make_config(vocab, **overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0 if model_type.startswith(("qwen", "mixtral")) else 0.0, 0.3)
            elif name.endswith((".bias", ".gate.weight")):  # biases and routers (zeros)
                param.normal_(0.0, 0.5)
    return model


def make_checkpoint(
    model_type: str, path: Path, tokenizer_dir: str, seed: int = 0, **overrides
) -> Path:
    """The folder of a random `model_type` checkpoint, with the tokenizer of `tokenizer_dir`
    (whose vocabulary size the model takes)."""
    vocab = json.loads((Path(tokenizer_dir) / "config.json").read_text())["vocab_size"]
    random_model(model_type, vocab, seed, **overrides).save_pretrained(str(path))
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_dir) / name, path / name)
    return path
