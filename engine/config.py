"""Engine configuration: plain frozen dataclasses used inside the hot loop.

Pydantic models at the cluster boundary (cluster/config.py) convert into these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
# fcfs: waiting requests in arrival order; priority: by (priority, arrival), and a preemption
# takes the running request with the highest priority value (latest arrival among equals).
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES = get_args(SchedulingPolicy)
DEFAULT_SCHEDULING_POLICY: SchedulingPolicy = "fcfs"
# none: weights in `dtype` (float32 on CPU is the exact mode); int8: per-channel int8 weights;
# int4: 4-bit weights in groups of 32 inputs; each where it measures faster, layer by layer, at
# load (CPU only; engine/models/quantized_linear)
Quantization = Literal["none", "int8", "int4"]
QUANTIZATIONS = get_args(Quantization)
DEFAULT_QUANTIZATION: Quantization = "none"


DEFAULT_NUM_BLOCKS = 1024
DEFAULT_TENSOR_PARALLEL_SIZE = 1  # ranks one instance's model is sharded over
# The ways to size an instance's KV pool; at most one is set (none: DEFAULT_NUM_BLOCKS).
KV_SIZING_FIELDS = ("num_blocks", "kv_cache_memory_fraction", "kv_cache_memory_bytes")


def kv_sizing_fields_set(settings: object) -> list[str]:
    """The KV_SIZING_FIELDS that `settings` sets; ValueError when more than one."""
    sizing = [name for name in KV_SIZING_FIELDS if getattr(settings, name) is not None]
    if len(sizing) > 1:
        raise ValueError(f"set only one of {', '.join(KV_SIZING_FIELDS)} (got {sizing})")
    return sizing


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV blocks in this instance's pool; None: sized by memory
    # Share of the device's memory for weights + KV cache; the KV cache gets it minus the
    # weights (engine/kv_budget.py says which memory).
    kv_cache_memory_fraction: float | None = None
    kv_cache_memory_bytes: int | None = None  # the KV cache's own size

    def __post_init__(self) -> None:
        if not kv_sizing_fields_set(self):
            object.__setattr__(self, "num_blocks", DEFAULT_NUM_BLOCKS)
        if self.block_size < 1 or (self.num_blocks is not None and self.num_blocks < 1):
            raise ValueError("block_size and num_blocks must be >= 1")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 128  # running requests at most
    max_model_len: int = 2048  # prompt + output tokens at most
    enable_prefix_caching: bool = True
    encoder_compute_budget: int = 4096  # encoder embeddings computed per step at most
    encoder_cache_size: int = 8192  # encoder embeddings held at most
    kv_load_failure_policy: str = "recompute"  # "recompute" locally or "fail" the request
    scheduling_policy: SchedulingPolicy = DEFAULT_SCHEDULING_POLICY

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_model_len < 2:
            raise ValueError("scheduler limits must be positive")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                f"got {self.kv_load_failure_policy!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )


# ngram: prompt lookup (engine/spec_decode/ngram_proposer.py); draft_model: a second, faster
# model with the target's tokenizer (engine/spec_decode/draft_model.py)
SpeculativeMethod = Literal["ngram", "draft_model"]
SPECULATIVE_METHODS = get_args(SpeculativeMethod)
DEFAULT_PROMPT_LOOKUP_MIN = 1
DEFAULT_PROMPT_LOOKUP_MAX = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's `speculative_config` dict form: each step a running
    request may verify `num_speculative_tokens` proposed tokens in one forward pass."""

    method: SpeculativeMethod
    num_speculative_tokens: int  # K: draft tokens proposed per step at most
    # ngram: the longest suffix n-gram, n from prompt_lookup_max down to prompt_lookup_min,
    # found earlier in prompt + output proposes the tokens that followed it.
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    # No speculation while more than this many requests run (None: at every batch size).
    disable_by_batch_size: int | None = None
    # draft_model: the draft's checkpoint (anything `LLM` takes: a folder, a GGUF file, a
    # packaged model's name; the target's own path drafts with itself) and its quantization
    # (None: the target's), e.g. the target in int4 drafting for itself in float32.
    model: str | None = None
    quantization: Quantization | None = None

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """The config of vLLM's dict form; ValueError naming an unknown key or a bad value."""
        if isinstance(settings, SpeculativeConfig):
            return settings
        if not isinstance(settings, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(settings).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}"
            )
        missing = [k for k in ("method", "num_speculative_tokens") if k not in settings]
        if missing:
            raise ValueError(f"speculative_config: {missing[0]!r} is required")
        return cls(**settings)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.method!r}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config: 'model' (the draft's checkpoint) is required with method "
                "'draft_model' and only there"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"speculative_config: quantization must be one of {QUANTIZATIONS} or None, "
                f"got {self.quantization!r}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(
                    f"speculative_config: {name} must be an integer >= 1, got {value!r}"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not "
                f"exceed prompt_lookup_max ({self.prompt_lookup_max})"
            )
        limit = self.disable_by_batch_size
        if limit is not None and (not _is_int(limit) or limit < 1):
            raise ValueError(
                f"speculative_config: disable_by_batch_size must be an integer >= 1 or None, "
                f"got {limit!r}"
            )


DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's --enable-lora): requests name an adapter in PEFT's format,
    and up to `max_loras` adapters run in one step's batch beside the base model."""

    max_loras: int = DEFAULT_MAX_LORAS  # adapters resident in the layers (one step's at most)
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK  # an adapter of a higher rank is refused
    max_cpu_loras: int | None = None  # adapters kept loaded in memory; None: max_loras

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (not _is_int(cpu) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras, got {cpu!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class EngineConfig:
    model: str  # Hugging Face style checkpoint folder
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"  # "auto": cuda when present, else cpu
    dtype: str = "auto"  # "auto": float32 on cpu, bfloat16 on cuda
    quantization: Quantization = DEFAULT_QUANTIZATION
    seed: int = 0
    sim_time_scale: float | None = None  # a sim: model's time scale; None: its profile's
    tensor_parallel_size: int = DEFAULT_TENSOR_PARALLEL_SIZE
    num_threads: int | None = None  # torch intra-op threads of this process; None: as started
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    lora: LoRAConfig | None = None  # None: no LoRA adapters

    @property
    def draft_model(self) -> SpeculativeConfig | None:
        """The speculative config when it drafts with a model (method draft_model)."""
        spec = self.speculative
        return spec if spec is not None and spec.method == "draft_model" else None

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.draft_model is not None and self.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_config: method 'draft_model' runs at tensor_parallel_size 1 "
                f"only, got {self.tensor_parallel_size}"
            )
        if self.lora is not None and self.tensor_parallel_size > 1:
            raise ValueError(
                f"LoRA runs at tensor_parallel_size 1 only, got {self.tensor_parallel_size}"
            )
        if self.quantization != "none" and self.tensor_parallel_size > 1:
            raise ValueError(
                f"quantization {self.quantization!r} runs at tensor_parallel_size 1 only, "
                f"got {self.tensor_parallel_size}"
            )
