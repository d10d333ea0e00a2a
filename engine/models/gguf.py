"""llama.cpp GGUF checkpoints of the Llama family, read with the `gguf` package.

`write_checkpoint_files(gguf_path, out_dir)` turns the file's metadata into the small files of a
Hugging Face checkpoint folder (config.json, generation_config.json, tokenizer.json,
tokenizer_config.json) and links the GGUF file into it as `model.gguf`; `read_tensors(path)`
yields the weights under transformers' names, dequantized to float32 one tensor at a time, so
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
SUPPORTED_ARCHITECTURE = "llama"

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` values whose text split differs from GPT-2's; any other value splits as
# GPT-2 does, as transformers does.
_PRE_TOKENIZER_SPLITS = dict.fromkeys(
    ("llama-bpe", "llama3", "llama-v3", "smaug-bpe"), _LLAMA3_SPLIT
)

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
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_gguf(path: str | Path) -> GGUFReader:
    """The file's reader, for a Llama-family GGUF; anything else raises ValueError."""
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:  # a bad magic number, a truncated file
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    architecture = _field(reader, "general.architecture")
    if architecture != SUPPORTED_ARCHITECTURE:
        raise ValueError(
            f"GGUF architecture {architecture!r} is not supported ({SUPPORTED_ARCHITECTURE} only)"
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
    """config.json of the equivalent transformers Llama checkpoint."""
    arch = SUPPORTED_ARCHITECTURE
    num_heads = int(_required(reader, f"{arch}.attention.head_count"))
    hidden = int(_required(reader, f"{arch}.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab_size = _field(reader, f"{arch}.vocab_size") or len(
        _required(reader, "tokenizer.ggml.tokens")
    )
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // num_heads)),
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, f"{arch}.feed_forward_length")),
        "max_position_embeddings": int(_required(reader, f"{arch}.context_length")),
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": num_heads,
        "num_hidden_layers": int(_required(reader, f"{arch}.block_count")),
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "rms_norm_eps": float(_required(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "vocab_size": int(vocab_size),
    }


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
def hf_tensor_name(name: str) -> str | None:
    """transformers' name of a GGUF tensor, or None for a tensor this loader does not know."""
    stem, dot, kind = name.rpartition(".")
    if stem in _TENSOR_NAMES:
        return f"{_TENSOR_NAMES[stem]}{dot}{kind}"
    match = _LAYER_TENSOR.match(name)
    if match is None or match.group(2) not in _LAYER_TENSOR_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[part]}.{kind}"


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
    has none) and a function that dequantizes it to a float32 tensor, q/k rows unpermuted."""
    reader = open_gguf(path)
    num_heads = int(_required(reader, "llama.attention.head_count"))
    num_kv_heads = int(_field(reader, "llama.attention.head_count_kv", num_heads))
    heads = {"self_attn.q_proj": num_heads, "self_attn.k_proj": num_kv_heads}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        rope_heads = next((n for part, n in heads.items() if name and f".{part}." in name), None)

        def load(
            tensor: ReaderTensor = tensor, rope_heads: int | None = rope_heads
        ) -> torch.Tensor:
            values = _dequantized(tensor)
            if rope_heads is not None:
                values = _unpermute_rope(values, rope_heads)
            return torch.from_numpy(np.require(values, np.float32, ["C", "W"]))

        yield name or tensor.name, load
