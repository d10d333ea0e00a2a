"""Load a Hugging Face checkpoint folder (config.json + *.safetensors, or a linked GGUF file)
into our models.

The model is built on the meta device and its parameters are assigned the checkpoint tensors
directly (already in the target dtype and device), so no weight is ever materialised twice.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pdcluster.engine.models import gguf
from pdcluster.engine.models.gemma import GEMMA_MODEL_TYPES, GemmaForCausalLM, gemma_config
from pdcluster.engine.models.llama import DecoderConfig, LlamaForCausalLM
from pdcluster.engine.models.llava import LlavaConfig, LlavaForConditionalGeneration

TEXT_ARCHITECTURES = {  # architecture -> model_type
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
}
LLAVA_ARCHITECTURE = "LlavaForConditionalGeneration"
SUPPORTED_ARCHITECTURES = (*TEXT_ARCHITECTURES, LLAVA_ARCHITECTURE)

# Checkpoint name prefixes of transformers>=4.52 (and of CLIPVisionModel's `vision_model.`
# level) mapped onto ours, which follow the older LLaVA layout.
_LLAVA_RENAMES = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("vision_tower.vision_model.", "vision_tower."),
)
# Mixtral's expert names mapped onto Qwen3-MoE's, which ours follow.
_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.(?:experts\.(\d+)\.(w[123])|(gate))\.")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_ALWAYS_UNUSED = re.compile(r"(rotary_emb\.inv_freq|embeddings\.position_ids)$")
_VISION_LAYER = re.compile(r"^vision_tower\.encoder\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    is_multimodal: bool
    image_token_id: int | None
    num_image_tokens: int | None  # embeddings per image after the select strategy
    image_size: int | None


def load_model(
    model_dir: str, device: torch.device, dtype: torch.dtype
) -> tuple[nn.Module, ModelInfo]:
    """Build the model of `model_dir` and load its weights."""
    path = Path(model_dir)
    architecture, config = _read_config(path)
    configs = _configs(architecture, config)
    model = _build(architecture, configs)
    state = _read_weights(path, model, device, dtype)
    _assign_weights(model, state)
    return model.eval().requires_grad_(False), _model_info(path, architecture, config, configs)


def read_model_info(model_dir: str) -> ModelInfo:
    """The model's shape and special tokens, from its config files alone: no module is built
    (building one, even on the meta device, costs every simulated instance a second of CPU)."""
    path = Path(model_dir)
    architecture, config = _read_config(path)
    return _model_info(path, architecture, config, _configs(architecture, config))


def _read_config(path: Path) -> tuple[str, dict[str, Any]]:
    config = _read_json(path / "config.json")
    if config is None:
        raise FileNotFoundError(f"no config.json in {path}")
    architecture = (config.get("architectures") or [None])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture!r} (model_type {config.get('model_type')!r}) is not "
            f"supported; supported: {SUPPORTED_ARCHITECTURES}"
        )
    return architecture, config


@dataclass(frozen=True)
class _Configs:
    """Our configs of a checkpoint: the text decoder's, and LLaVA's around it (if any)."""

    text: DecoderConfig
    text_dict: dict[str, Any]  # the decoder's part of config.json
    llava: LlavaConfig | None = None


def _configs(architecture: str, config: dict[str, Any]) -> _Configs:
    if architecture == LLAVA_ARCHITECTURE:
        llava = LlavaConfig.from_hf(config)
        return _Configs(llava.text, config.get("text_config") or {}, llava)
    model_type = TEXT_ARCHITECTURES[architecture]
    if model_type in GEMMA_MODEL_TYPES:
        return _Configs(gemma_config(config, model_type), config)
    return _Configs(DecoderConfig.from_hf(config, model_type), config)


def _build(architecture: str, configs: _Configs) -> nn.Module:
    """The model on the meta device (no memory until its weights are assigned)."""
    with torch.device("meta"):
        if configs.llava is not None:
            return LlavaForConditionalGeneration(configs.llava)
        if TEXT_ARCHITECTURES[architecture] in GEMMA_MODEL_TYPES:
            return GemmaForCausalLM(configs.text)
        return LlamaForCausalLM(configs.text)


def _model_info(
    path: Path, architecture: str, config: dict[str, Any], configs: _Configs
) -> ModelInfo:
    generation = _read_json(path / "generation_config.json") or {}
    text, llava = configs.text, configs.llava
    ids = (config, configs.text_dict, generation)
    return ModelInfo(
        architecture=architecture,
        num_layers=text.num_layers,
        num_heads=text.num_heads,
        num_kv_heads=text.num_kv_heads,
        head_dim=text.head_dim,
        hidden_size=text.hidden_size,
        vocab_size=text.vocab_size,
        max_position_embeddings=text.max_position_embeddings,
        eos_token_ids=_token_ids("eos_token_id", *ids),
        bos_token_id=(_token_ids("bos_token_id", *ids) or [None])[0],
        is_multimodal=llava is not None,
        image_token_id=llava.image_token_id if llava else None,
        num_image_tokens=llava.num_image_tokens if llava else None,
        image_size=llava.vision.image_size if llava else None,
    )


def _token_ids(key: str, *sources: dict[str, Any]) -> list[int]:
    """Union, in order, of the ids under `key` (an int or a list) in each source."""
    ids: list[int] = []
    for source in sources:
        value = source.get(key)
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
    return ids


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _weight_files(path: Path) -> list[Path]:
    index = _read_json(path / "model.safetensors.index.json")
    if index is not None:
        return [path / name for name in sorted(set(index["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def _our_name(name: str, model: nn.Module) -> str | None:
    """Checkpoint name -> our parameter name, or None for weights we knowingly drop."""
    if _ALWAYS_UNUSED.search(name):
        return None
    if ".block_sparse_moe." in name:
        return _MIXTRAL_EXPERT.sub(_mixtral_to_ours, name)
    if isinstance(model, LlavaForConditionalGeneration):
        for old, new in _LLAVA_RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
        if name.startswith("vision_tower.post_layernorm."):
            return None  # features are taken before it
        layer = _VISION_LAYER.match(name)
        if layer and int(layer.group(1)) >= len(model.vision_tower.encoder.layers):
            return None  # past the selected feature layer
    return name


def module_name(checkpoint_name: str, model: nn.Module) -> str | None:
    """A checkpoint's module name (e.g. a LoRA adapter's target) -> ours, or None for a
    module we drop."""
    name = _our_name(f"{checkpoint_name}.weight", model)
    return None if name is None else name.removesuffix(".weight")


def _mixtral_to_ours(match: re.Match[str]) -> str:
    expert, proj, gate = match.groups()
    return ".mlp.gate." if gate else f".mlp.experts.{expert}.{_MIXTRAL_PROJ[proj]}."


def _tied_lm_head(model: nn.Module) -> str | None:
    if isinstance(model, LlavaForConditionalGeneration):
        return "language_model.lm_head.weight" if model.config.text.tie_word_embeddings else None
    return "lm_head.weight" if model.config.tie_word_embeddings else None


def _checkpoint_tensors(path: Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(checkpoint name, loader) for every tensor: from the GGUF file the folder links to, or
    from its safetensors files. A tensor is read only when its loader is called."""
    if (path / gguf.GGUF_WEIGHTS).exists():
        yield from gguf.read_tensors(path / gguf.GGUF_WEIGHTS)
        return
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield key, functools.partial(f.get_tensor, key)


def _read_weights(
    path: Path, model: nn.Module, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    expected = dict(model.state_dict(keep_vars=True))
    tied = _tied_lm_head(model)
    expected.pop(tied, None)
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for key, load in _checkpoint_tensors(path):
        name = _our_name(key, model)
        if name is None or name == tied:
            continue
        if name not in expected:
            unexpected.append(key)
            continue
        tensor = load()
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"weight {key}: shape {tuple(tensor.shape)} in the checkpoint, "
                f"{tuple(expected[name].shape)} expected from config.json"
            )
        to_dtype = dtype if tensor.is_floating_point() else tensor.dtype
        state[name] = tensor.to(device=device, dtype=to_dtype)
    missing = sorted(set(expected) - set(state))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the model: missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''} ({len(missing)}), unexpected "
            f"{unexpected[:8]}{'...' if len(unexpected) > 8 else ''} ({len(unexpected)})"
        )
    return state


def _assign_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Replace the meta parameters by the loaded tensors, then re-tie lm_head."""
    result = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover or result.unexpected_keys:
        raise ValueError(f"weights not loaded: {leftover} {result.unexpected_keys}")
