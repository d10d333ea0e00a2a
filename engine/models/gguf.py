"""llama.cpp GGUF checkpoints, read with the `gguf` package: `llama` (Llama, and Mixtral when it
has experts), `qwen2`, `qwen3`, `qwen3moe`, `gemma2` and `gemma3`.

`write_checkpoint_files(gguf_path, out_dir)` turns the file's metadata into the small files of a
Hugging Face checkpoint folder (config.json, generation_config.json, tokenizer.json,
tokenizer_config.json) and links the GGUF file into it as `model.gguf`; `read_tensors(path)`
yields the weights under transformers' names (a MoE's merged `ffn_*_exps` tensors as one tensor
per expert, named as Qwen3-MoE checkpoints name them), dequantized to float32 one tensor at a time, so
no float copy of the checkpoint is ever written. Both follow transformers' own GGUF loading,
which is the reference the tests compare against.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

GGUF_WEIGHTS = "model.gguf"  # in a checkpoint folder: a link to the GGUF file holding the weights
# GGUF architecture -> (transformers architecture, model_type); llama with experts is Mixtral.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
_MIXTRAL = ("MixtralForCausalLM", "mixtral")
# llama.cpp interleaves the rotary halves of q/k rows only for these (GPT-J-style rope).
_PERMUTED_ROPE = ("llama",)
# llama.cpp stores Gemma's RMSNorm weights as 1 + w (ggml scales by w).
_UNIT_OFFSET_NORMS = ("gemma2", "gemma3")

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` values whose text split differs from GPT-2's; any other value splits as
# GPT-2 does, as transformers does.
_PRE_TOKENIZER_SPLITS = dict.fromkeys(
    ("llama-bpe", "llama3", "llama-v3", "smaug-bpe"), _LLAMA3_SPLIT
) | {"qwen2": _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")}  # Qwen splits single digits

_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
_GEMMA_LAYER_TENSOR_NAMES = {  # Gemma's sandwich norms
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_EXPERT_TENSOR_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_gguf(path: str | Path) -> GGUFReader:
    """The file's reader, for a GGUF of one of `ARCHITECTURES`; else ValueError."""
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:  # a bad magic number, a truncated file
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    architecture = _field(reader, "general.architecture")
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {architecture!r} is not supported ({', '.join(ARCHITECTURES)})"
        )
    return reader


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python scalar, string or list."""
    field = reader.get_field(key)
    if field is None:
        return default
    if field.types[0] == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    return field.contents()


def _required(reader: GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata has no {key}")
    return value


# ---- config.json and generation_config.json ---------------------------------------------------
def hf_config(reader: GGUFReader) -> dict[str, Any]:
    """config.json of the equivalent transformers checkpoint."""
    arch = _field(reader, "general.architecture")
    num_heads = int(_required(reader, f"{arch}.attention.head_count"))
    hidden = int(_required(reader, f"{arch}.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab_size = _field(reader, f"{arch}.vocab_size") or len(
        _required(reader, "tokenizer.ggml.tokens")
    )
    head_dim = _field(reader, f"{arch}.attention.key_length") or _field(
        reader, f"{arch}.rope.dimension_count", hidden // num_heads
    )
    num_experts = int(_field(reader, f"{arch}.expert_count", 0))
    architecture, model_type = _MIXTRAL if arch == "llama" and num_experts else ARCHITECTURES[arch]
    config = {
        "architectures": [architecture],
        "attention_bias": "blk.0.attn_q.bias" in tensor_names and arch != "qwen2",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, f"{arch}.feed_forward_length")),
        "max_position_embeddings": int(_required(reader, f"{arch}.context_length")),
        "mlp_bias": False,
        "model_type": model_type,
        "num_attention_heads": num_heads,
        "num_hidden_layers": int(_required(reader, f"{arch}.block_count")),
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "rms_norm_eps": float(_required(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "vocab_size": int(vocab_size),
    }
    return {**config, **_moe_config(reader, arch, num_experts), **_gemma_config(reader, arch)}


def _moe_config(reader: GGUFReader, arch: str, num_experts: int) -> dict[str, Any]:
    if not num_experts:
        return {}
    config = {
        "num_experts_per_tok": int(_required(reader, f"{arch}.expert_used_count")),
        "num_local_experts": num_experts,
    }
    if arch == "qwen3moe":
        config["num_experts"] = num_experts
        config["moe_intermediate_size"] = int(
            _required(reader, f"{arch}.expert_feed_forward_length")
        )
        # llama.cpp renormalises Qwen3-MoE's top-k weights unless the file says otherwise.
        config["norm_topk_prob"] = bool(_field(reader, f"{arch}.expert_weights_norm", True))
    return config


def _gemma_config(reader: GGUFReader, arch: str) -> dict[str, Any]:
    """Gemma's extras. llama.cpp keeps no query_pre_attn_scalar: it scales by head_dim, and
    Gemma 3's sliding layers have RoPE base 10000 and every 6th layer is full."""
    if arch not in _UNIT_OFFSET_NORMS:
        return {}
    config = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": int(_required(reader, f"{arch}.attention.key_length")),
        "sliding_window": _field(reader, f"{arch}.attention.sliding_window"),
        "attn_logit_softcapping": _field(reader, f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": _field(reader, f"{arch}.final_logit_softcapping"),
        "sliding_window_pattern": _field(reader, f"{arch}.attention.sliding_window_pattern"),
    }
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if arch == "gemma3" and factor is not None:
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    return config


def generation_config(reader: GGUFReader) -> dict[str, Any]:
    """Generation stops on the EOS token and on the end-of-turn / end-of-message tokens."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    stop_ids = [_field(reader, f"tokenizer.ggml.{key}") for key in keys]
    return {
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(i for i in stop_ids if i is not None)),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }


# ---- tokenizer.json and tokenizer_config.json -------------------------------------------------
@functools.cache
def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (its byte alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    unprintable = (b for b in range(256) if b not in printable)
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(unprintable)}


@functools.cache
def _byte_alphabet() -> frozenset[str]:
    return frozenset(_byte_to_char().values())


def _byte_spelling(token: str) -> str:
    """A vocabulary entry in the byte alphabet (some files store a few tokens as raw text)."""
    if set(token) <= _byte_alphabet():
        return token
    return "".join(_byte_to_char()[b] for b in token.encode("utf-8"))


def build_tokenizer(reader: GGUFReader) -> HFTokenizer:
    """The byte-level BPE tokenizer the metadata describes (`tokenizer.ggml.model` 'gpt2')."""
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer {kind!r} is not supported (byte-level BPE 'gpt2' only)")
    tokens = _required(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _required(reader, "tokenizer.ggml.merges")]
    vocab = {_byte_spelling(token): i for i, token in enumerate(tokens)}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS.get(_field(reader, "tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    _add_special_tokens(tokenizer, tokens, _field(reader, "tokenizer.ggml.token_type") or [])
    return tokenizer


def _add_special_tokens(tokenizer: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens (`<|im_start|>`) become special added tokens, user-defined ones plain
    added tokens: either way the text holding them is never cut inside them. A control token
    spelled outside the byte alphabet is a mislabel and stays an ordinary vocabulary entry."""
    control = [t for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= _byte_alphabet()]
    user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def tokenizer_config(reader: GGUFReader) -> dict[str, Any]:
    tokens = _required(reader, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        token_id = _field(reader, f"tokenizer.ggml.{key}")
        return None if token_id is None else tokens[token_id]

    return {
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "bos_token": token("bos_token_id"),
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": token("unknown_token_id"),
    }


def write_checkpoint_files(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the checkpoint folder of a GGUF file: its metadata as Hugging Face files, and
    `model.gguf`, a link to the (absolute) GGUF path that the weights are read from."""
    gguf_path, out = Path(gguf_path).resolve(), Path(out_dir)
    reader = open_gguf(gguf_path)
    files = {
        "config.json": hf_config(reader),
        "generation_config.json": generation_config(reader),
        "tokenizer_config.json": tokenizer_config(reader),
    }
    tokenizer = build_tokenizer(reader)
    out.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        text = json.dumps(content, indent=2, ensure_ascii=False)
        (out / name).write_text(text + "\n", encoding="utf-8")
    (out / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    os.symlink(gguf_path, out / GGUF_WEIGHTS)
    return out


# ---- weights ---------------------------------------------------------------------------------
def hf_tensor_name(name: str, arch: str = "llama") -> str | None:
    """transformers' name of a GGUF tensor, or None for a tensor this loader does not know.
    A merged expert tensor gets the name with `{expert}` left to fill in."""
    stem, dot, kind = name.rpartition(".")
    if stem in _TENSOR_NAMES:
        return f"{_TENSOR_NAMES[stem]}{dot}{kind}"
    match = _LAYER_TENSOR.match(name)
    if match is None:
        return None
    layer, part, kind = match.groups()
    names = _LAYER_TENSOR_NAMES
    if arch in _UNIT_OFFSET_NORMS:
        names = {**names, **_GEMMA_LAYER_TENSOR_NAMES}
    if part in _EXPERT_TENSOR_NAMES:
        return f"model.layers.{layer}.mlp.experts.{{expert}}.{_EXPERT_TENSOR_NAMES[part]}.{kind}"
    if part not in names:
        return None
    return f"model.layers.{layer}.{names[part]}.{kind}"


def _unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order. Per head, llama.cpp interleaves the two rotary halves
    (rows 0, d/2, 1, d/2+1, ...) for its GPT-J-style rope; transformers keeps them in halves."""
    # [num_heads * head_dim, ...] -> [num_heads, head_dim // 2, 2, ...] -> swap the middle axes
    rows = weight.reshape(num_heads, weight.shape[0] // num_heads // 2, 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


def _dequantized(tensor: ReaderTensor) -> np.ndarray:
    """The tensor in float32, in PyTorch's axis order (GGUF lists the axes innermost first)."""
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        kind = GGMLQuantizationType(tensor.tensor_type).name
        raise ValueError(
            f"tensor {tensor.name} has type {kind}, which cannot be dequantized"
        ) from None
    return values.reshape(tuple(int(n) for n in reversed(tensor.shape)))


def read_tensors(path: str | Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(name, loader) for every tensor of the file: transformers' name (the GGUF name when it
    has none) and a function that dequantizes it to a float32 tensor, as transformers reads
    it: q/k rows unpermuted, Gemma's norms without llama.cpp's +1, merged experts split."""
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    num_heads = int(_required(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", num_heads))
    heads = {"self_attn.q_proj": num_heads, "self_attn.k_proj": num_kv_heads}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, arch)
        rope_heads = None
        if arch in _PERMUTED_ROPE:
            rope_heads = next(
                (n for part, n in heads.items() if name and f".{part}." in name), None
            )
        unit_offset = arch in _UNIT_OFFSET_NORMS and tensor.name.endswith("norm.weight")
        load = functools.partial(_load, tensor, rope_heads, unit_offset)
        if name is not None and "{expert}" in name:
            yield from _split_experts(name, tensor, load)
        else:
            yield name or tensor.name, load


def _load(tensor: ReaderTensor, rope_heads: int | None, unit_offset: bool) -> torch.Tensor:
    values = _dequantized(tensor)
    if rope_heads is not None:
        values = _unpermute_rope(values, rope_heads)
    if unit_offset:
        values = values - 1.0
    return torch.from_numpy(np.require(values, np.float32, ["C", "W"]))


def _split_experts(
    name: str, tensor: ReaderTensor, load: Callable[[], torch.Tensor]
) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """One (name, loader) per expert of a merged [experts, rows, cols] tensor; the merged
    tensor is dequantized once, when the first expert's loader runs."""
    merged = functools.cache(load)
    num_experts = int(tensor.shape[-1])  # GGUF lists the axes innermost first
    for expert in range(num_experts):
        yield name.format(expert=expert), lambda e=expert: merged()[e].clone()
