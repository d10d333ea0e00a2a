"""Engine configuration: plain frozen dataclasses used inside the hot loop.

Pydantic models at the cluster boundary (cluster/config.py) convert into these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 1024  # KV blocks in this instance's pool

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_blocks < 1:
            raise ValueError("block_size and num_blocks must be >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 128  # running requests at most
    max_model_len: int = 2048  # prompt + output tokens at most
    enable_prefix_caching: bool = True
    encoder_compute_budget: int = 4096  # encoder embeddings computed per step at most
    encoder_cache_size: int = 8192  # encoder embeddings held at most
    kv_load_failure_policy: str = "recompute"  # "recompute" locally or "fail" the request

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_model_len < 2:
            raise ValueError("scheduler limits must be positive")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                f"got {self.kv_load_failure_policy!r}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: str  # Hugging Face style checkpoint folder
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"  # "auto": cuda when present, else cpu
    dtype: str = "auto"  # "auto": float32 on cpu, bfloat16 on cuda
    seed: int = 0
