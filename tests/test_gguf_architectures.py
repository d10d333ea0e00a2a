"""GGUF files of the Qwen2, Qwen3, Qwen3-MoE, Mixtral (llama with experts) and Gemma 2/3 layouts,
written here as llama.cpp's converter writes them (the `gguf` package's tensor names, merged
expert tensors, permuted llama q/k rows, Gemma norms stored as 1 + w), load into the very
model that the transformers checkpoint they came from loads into."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pdcluster.engine.models import gguf as our_gguf
from pdcluster.engine.models.loader import load_model
from tests.arch_checkpoints import make_checkpoint
from tests.test_gguf import _add_tokenizer, _llama_cpp_permute

gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
GGUF_ARCH = {  # model_type -> GGUF architecture
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "mixtral": gguf.MODEL_ARCH.LLAMA,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
}
# What llama.cpp's files cannot say: it keeps no query_pre_attn_scalar (Gemma's scores are
# scaled by head_dim) and its qwen3moe has no dense layers.
GGUF_EXPRESSIBLE = {
    "gemma2": {"query_pre_attn_scalar": 16},
    "gemma3_text": {"query_pre_attn_scalar": 16},
    "qwen3_moe": {"mlp_only_layers": []},
    "qwen2": {},
    "qwen3": {},
    "mixtral": {},
}


def _add_metadata(writer, config: dict) -> None:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if "num_local_experts" in config:
        writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if "moe_intermediate_size" in config:
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_weights_norm(config["norm_topk_prob"])
    if config["model_type"].startswith("gemma"):
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern(2)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if config.get(key) is not None:
                getattr(writer, f"add_{key}")(config[key])


def _gguf_tensors(weights: dict[str, torch.Tensor], config: dict, arch) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under llama.cpp's names and in its layout."""
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    heads = {".q_proj.": config["num_attention_heads"], ".k_proj.": config["num_key_value_heads"]}
    out: dict[str, np.ndarray] = {}
    for hf_name, tensor in sorted(weights.items()):
        if ".mlp.experts." in hf_name or ".block_sparse_moe.experts." in hf_name:
            if ".experts.0." not in hf_name:
                continue  # every expert goes into one merged tensor, written with expert 0
            stem, rest = hf_name.split(".experts.0.")
            proj = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}.get(rest[:2], rest)
            proj = proj.removesuffix(".weight")
            merged = torch.stack(
                [
                    weights[k]
                    for k in sorted(weights)
                    if k.startswith(stem + ".experts.") and k.endswith(rest)
                ]
            )
            name = names.get_name(f"{stem.replace('block_sparse_moe', 'mlp')}.experts.{proj}")
            out[f"{name}.weight"] = merged.numpy()
            continue
        values = tensor.numpy()
        if arch == gguf.MODEL_ARCH.LLAMA:
            part = next((p for p in heads if p in hf_name), None)
            if part is not None:
                values = _llama_cpp_permute(tensor, heads[part])
        if config["model_type"].startswith("gemma") and hf_name.endswith("norm.weight"):
            values = values + 1.0
        out[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))] = values
    return out


def write_gguf(model_dir: Path, out: Path, model_type: str) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[model_type]
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    _add_metadata(writer, config)
    _add_tokenizer(writer, model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    for name, values in _gguf_tensors(weights, config, arch).items():
        writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("model_type", sorted(GGUF_ARCH))
def test_gguf_loads_the_same_model(model_type, preset_dir, tmp_path):
    hf_dir = make_checkpoint(
        model_type, tmp_path / "hf", preset_dir("tiny-llama"), **GGUF_EXPRESSIBLE[model_type]
    )
    gguf_file = write_gguf(hf_dir, tmp_path / f"{model_type}.gguf", model_type)
    folder = our_gguf.write_checkpoint_files(gguf_file, tmp_path / "from-gguf")
    want, want_info = load_model(str(hf_dir), CPU, torch.float32)
    got, got_info = load_model(str(folder), CPU, torch.float32)
    # GGUF stores the epsilon as float32.
    assert got.config.rms_norm_eps == pytest.approx(want.config.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(got.config, rms_norm_eps=want.config.rms_norm_eps) == want.config
    assert type(got) is type(want) and got_info == want_info
    want_state, got_state = want.state_dict(), got.state_dict()
    assert got_state.keys() == want_state.keys()
    for name, tensor in want_state.items():
        torch.testing.assert_close(got_state[name], tensor, atol=1e-6, rtol=0, msg=name)
