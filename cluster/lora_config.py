"""LoRA settings of an instance's engine (vLLM's `--enable-lora` flags), part of the engine
settings (`engine:` in the YAML, a role's overrides)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from pdcluster.cluster.config_yaml import StrictSection
from pdcluster.engine.config import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, LoRAConfig
from pdcluster.engine.lora.adapter import LoRARequest


class LoRASettings(StrictSection):
    enable_lora: bool = Field(
        False, description="serve LoRA adapters (PEFT's format) beside the base model: a "
        "request names one as its `model`; set on every instance that runs requests",
    )  # fmt: skip
    max_loras: int = Field(
        DEFAULT_MAX_LORAS, ge=1, description="LoRA adapters one step's batch runs at most "
        "(each resident in the instance's layers)",
    )  # fmt: skip
    max_lora_rank: int = Field(
        DEFAULT_MAX_LORA_RANK, ge=1, description="an adapter of a higher rank is refused"
    )
    max_cpu_loras: int | None = Field(
        None, ge=1, description="LoRA adapters an instance keeps loaded in memory (unset: "
        "max_loras); the others are read from their folder again when used",
    )  # fmt: skip
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters served from the start: name -> "
        "folder (as vLLM's --lora-modules name=path); more load at run time through "
        "POST /v1/load_lora_adapter",
    )  # fmt: skip

    @field_validator("lora_modules")
    @classmethod
    def _absolute_lora_paths(cls, value: dict[str, str]) -> dict[str, str]:
        return {name: absolute_folder(path) for name, path in value.items()}

    @model_validator(mode="after")
    def _check_lora(self) -> LoRASettings:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules need enable_lora")
        self.lora_config()  # ValueError: pydantic reports it
        return self

    def lora_config(self) -> LoRAConfig | None:
        """The engine's LoRA config; None without enable_lora."""
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def adapters(self) -> dict[str, LoRARequest]:
        """The LoRA adapters served from the start (`lora_modules`), by name."""
        return {name: LoRARequest(name, path) for name, path in self.lora_modules.items()}


def absolute_folder(path: str) -> str:
    """An adapter's folder as an absolute path: every instance reads it, whatever its cwd."""
    return str(Path(path).expanduser().resolve())


def check_same_lora(settings: list[LoRASettings]) -> None:
    """ValueError unless `settings` (of the roles that run requests) agree on enable_lora and
    lora_modules: a request's adapter runs on each instance it passes."""
    if len({(s.enable_lora, tuple(sorted(s.lora_modules.items()))) for s in settings}) > 1:
        raise ValueError(
            "enable_lora and lora_modules must be the same for prefill, decode and mixed "
            "instances: a request's adapter runs on each instance it passes"
        )
