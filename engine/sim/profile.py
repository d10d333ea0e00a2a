"""Simulation profiles: the step-time model, modeled KV shape and link of a `sim:` model.

A profile is JSON (the pydantic `SimProfile` is its schema); the runner uses the frozen
`StepTimeModel` made from it. `sim_model_dir` turns a profile into a checkpoint folder without
weights: the tokenizer model's config and tokenizer files plus `sim_profile.json`, so the
gateway, tokenizer and config readers see an ordinary model folder.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from pdcluster.engine.config import CacheConfig

SIM_PREFIX = "sim:"
SIM_PROFILE_FILE = "sim_profile.json"  # in a checkpoint folder: it is a simulated model
BUILTIN_DIR = Path(__file__).parent / "profiles"
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin")


class StepCoefficients(BaseModel):
    """Seconds of one step: prefill and decode parts add up when a step holds both, with one
    fixed cost for the step (`mixed_base_s` when both are there)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill_base_s: float = Field(0.0, ge=0, description="a: fixed cost of a step with prefill")
    prefill_per_token_s: float = Field(0.0, ge=0, description="b: per prefill token")
    prefill_per_token_context_s: float = Field(
        0.0, ge=0, description="c: per prefill token x its context length (attention)"
    )
    decode_base_s: float = Field(0.0, ge=0, description="d: fixed cost of a step with decode")
    decode_per_seq_s: float = Field(0.0, ge=0, description="e: per decode sequence")
    decode_per_context_token_s: float = Field(
        0.0, ge=0, description="f: per token of context summed over decode sequences"
    )
    mixed_base_s: float | None = Field(
        None,
        ge=0,
        description="fixed cost of a step with both prefill and decode rows (default: the "
        "larger of the two bases, one forward pass reading the weights once)",
    )
    encoder_base_s: float = Field(0.0, ge=0, description="fixed cost of an encoder batch")
    encoder_per_image_s: float = Field(0.0, ge=0, description="per image encoded")


class KVShape(BaseModel):
    """The modeled model's KV cache: what a P->D transfer of one token moves."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: int = Field(..., ge=1, description="decoder layers")
    num_kv_heads: int = Field(..., ge=1, description="KV heads (all TP ranks together)")
    head_dim: int = Field(..., ge=1, description="dimension of one head")
    dtype_bytes: int = Field(2, ge=1, description="bytes per KV element")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


class VisionShape(BaseModel):
    """The modeled vision tower's input: what one image expands to in the prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image_size: int = Field(..., ge=1, description="input side in pixels (e.g. 336)")
    patch_size: int = Field(..., ge=1, description="patch side in pixels (e.g. 14)")

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens per image (LLaVA's default select strategy: the patches)."""
        return (self.image_size // self.patch_size) ** 2


class FitReport(BaseModel):
    """How well the coefficients reproduce the measured step times."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    points: list[dict[str, float]] = Field(
        default_factory=list, description="measured shapes with measured and fitted seconds"
    )
    max_rel_error: float = Field(0.0, ge=0, description="largest |fit - measured| / measured")
    mean_rel_error: float = Field(0.0, ge=0, description="mean |fit - measured| / measured")


class SimProfile(BaseModel):
    """Schema of a simulation profile file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(..., description="what is modeled, e.g. 'h100-llama-3.1-8b'")
    description: str = Field("", description="hardware, parallelism, how the numbers were made")
    estimate: bool = Field(False, description="true: derived from published figures, not fitted")
    sources: list[str] = Field(default_factory=list, description="where the numbers come from")
    tokenizer: str = Field(
        ..., description="model whose tokenizer, chat template and vocab are used (any model "
        "name or folder the engine takes, e.g. 'preset:tiny-llama' or 'smollm2-135m')"
    )  # fmt: skip
    step: StepCoefficients = Field(..., description="the step-time model")
    kv: KVShape = Field(..., description="the modeled KV cache shape")
    vision: VisionShape | None = Field(
        None, description="the modeled vision tower's image tokens (needs a LLaVA-style "
        "tokenizer model; None: the tokenizer model's own)"
    )  # fmt: skip
    eos_probability: float = Field(
        0.0, ge=0, lt=1, description="chance that a generated token is EOS (never with ignore_eos)"
    )
    link_bandwidth_bytes_per_s: float = Field(
        50e9, gt=0, description="P->D KV link bandwidth of the modeled cluster"
    )
    link_latency_s: float = Field(0.0, ge=0, description="fixed cost of one P->D KV transfer")
    time_scale: float = Field(
        1.0, gt=0, description="every modeled duration runs this many times slower"
    )
    device_memory_bytes: int | None = Field(
        None, ge=1, description="modeled device memory (for kv_cache_memory_fraction)"
    )
    weight_bytes: int = Field(0, ge=0, description="modeled weights (for the fraction)")
    max_model_len: int | None = Field(
        None, ge=2, description="modeled context length (default: the tokenizer model's)"
    )
    fit: FitReport | None = Field(None, description="measured points and fit error")


@dataclass(frozen=True)
class StepShape:
    """What one step computes: per prefill request (new tokens, context before them), per
    decode sequence its context length, and the images encoded."""

    prefill: tuple[tuple[int, int], ...] = ()
    decode_contexts: tuple[int, ...] = ()
    num_images: int = 0


@dataclass(frozen=True)
class StepTimeModel:
    """The hot-loop form of a profile's timing parts (modeled seconds, before time_scale)."""

    step: StepCoefficients
    kv_bytes_per_token: int
    link_bandwidth_bytes_per_s: float
    link_latency_s: float

    @classmethod
    def of(cls, profile: SimProfile) -> StepTimeModel:
        return cls(
            profile.step,
            profile.kv.bytes_per_token,
            profile.link_bandwidth_bytes_per_s,
            profile.link_latency_s,
        )

    def step_s(self, shape: StepShape) -> float:
        c, total, base = self.step, 0.0, 0.0
        if shape.prefill:
            tokens = sum(n for n, _ in shape.prefill)
            # Attention of n new tokens after `ctx` cached ones: each sees ctx + (its index).
            attention = sum(n * (ctx + (n - 1) / 2) for n, ctx in shape.prefill)
            base = c.prefill_base_s
            total += c.prefill_per_token_s * tokens + c.prefill_per_token_context_s * attention
        if shape.decode_contexts:
            total += c.decode_per_seq_s * len(shape.decode_contexts)
            total += c.decode_per_context_token_s * sum(shape.decode_contexts)
            if not shape.prefill:
                base = c.decode_base_s
            elif c.mixed_base_s is not None:
                base = c.mixed_base_s
            else:
                base = max(base, c.decode_base_s)
        total += base
        if shape.num_images:
            total += c.encoder_base_s + c.encoder_per_image_s * shape.num_images
        return total

    def transfer_s(self, num_tokens: int) -> float:
        """Modeled time to move `num_tokens` tokens of KV over the P->D link."""
        return self.link_latency_s + num_tokens * self.kv_bytes_per_token / (
            self.link_bandwidth_bytes_per_s
        )


def sim_cache(cache: CacheConfig, profile: SimProfile) -> CacheConfig:
    """`cache` with `num_blocks` fixed: as given, or what a memory budget holds of the
    modeled model's KV (the modeled device's memory minus its weights, for a fraction)."""
    if cache.num_blocks is not None:
        return cache
    block_bytes = profile.kv.bytes_per_token * cache.block_size
    budget = cache.kv_cache_memory_bytes
    if budget is None:
        if profile.device_memory_bytes is None:
            raise ValueError(
                f"kv_cache_memory_fraction: sim profile {profile.name!r} models no device "
                "memory; set num_blocks or kv_cache_memory_bytes"
            )
        budget = int(profile.device_memory_bytes * cache.kv_cache_memory_fraction)
        budget -= profile.weight_bytes
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(f"the KV memory budget ({budget} bytes) holds no block of the profile")
    return replace(
        cache, num_blocks=num_blocks, kv_cache_memory_fraction=None, kv_cache_memory_bytes=None
    )


def builtin_profiles() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.json"))


def profile_path(name_or_path: str) -> Path:
    """The file of a built-in profile name or a path to a JSON file."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"sim profile {name_or_path} is not a file")
        return path
    builtin = BUILTIN_DIR / f"{name_or_path}.json"
    if not builtin.is_file():
        raise ValueError(
            f"unknown sim profile {name_or_path!r}; built-in: {builtin_profiles()} "
            "(or a path to a .json profile)"
        )
    return builtin


def load_profile(name_or_path: str | Path) -> SimProfile:
    path = profile_path(str(name_or_path))
    try:
        return SimProfile.model_validate_json(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"sim profile {path}: {e}") from e


def read_folder_profile(model_dir: str | Path) -> SimProfile | None:
    """The profile of a simulated model's folder; None for a real model."""
    path = Path(model_dir) / SIM_PROFILE_FILE
    return load_profile(path) if path.is_file() else None


def profile_digest(profile: SimProfile) -> str:
    """Keys a simulated model's folder by the profile's content."""
    return hashlib.sha256(profile.model_dump_json().encode()).hexdigest()[:16]


def write_sim_folder(profile: SimProfile, tokenizer_dir: str | Path, out: Path) -> None:
    """A weightless checkpoint folder: the tokenizer model's config and tokenizer files (so
    prompts tokenize as on that model) plus the profile."""
    for item in Path(tokenizer_dir).iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copyfile(item, out / item.name)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    if profile.max_model_len is not None:
        text = config.get("text_config", config)  # multimodal configs nest the decoder's
        text["max_position_embeddings"] = profile.max_model_len
    if profile.vision is not None:
        _set_vision(config, profile)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    write_profile(profile, out / SIM_PROFILE_FILE)


def _set_vision(config: dict, profile: SimProfile) -> None:
    """The modeled tower's image size and patch in a LLaVA-style config, so that an image
    expands to its token count. Pixels keep the tokenizer model's preprocessing (its
    preprocessor_config.json): a simulated encoder never reads them."""
    vision = config.get("vision_config")
    if vision is None:
        raise ValueError(
            f"sim profile {profile.name!r} models a vision tower: its tokenizer "
            f"{profile.tokenizer!r} must be a LLaVA-style model (e.g. preset:tiny-llava)"
        )
    vision["image_size"] = profile.vision.image_size
    vision["patch_size"] = profile.vision.patch_size
    config["image_seq_length"] = profile.vision.num_image_tokens


def write_profile(profile: SimProfile, out: str | Path) -> None:
    Path(out).write_text(
        json.dumps(profile.model_dump(mode="json"), indent=2) + "\n", encoding="utf-8"
    )
