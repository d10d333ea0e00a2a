"""The bodies of our admin endpoints: `POST /v1/admin/scale`, and vLLM's LoRA adapter loading
and unloading."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    """Our own (non-OpenAI) bodies: a typo is a 400."""

    model_config = ConfigDict(extra="forbid")


class ScaleRequest(_Body):
    """`POST /v1/admin/scale`: run `count` instances of `role` (adding, or draining the
    newest away)."""

    role: Literal["encoder", "prefill", "decode", "mixed"] = Field(description="the role to resize")
    count: int = Field(ge=0, le=64, description="instances of the role wanted")


class LoadLoRAAdapterRequest(_Body):
    """`POST /v1/load_lora_adapter` (vLLM's): serve the PEFT adapter in `lora_path` as the
    model `lora_name`."""

    lora_name: str = Field(min_length=1, description="the adapter's model id in requests")
    lora_path: str = Field(min_length=1, description="its folder, readable by every instance")
    load_inplace: bool = Field(False, description="vLLM's; replacing an adapter is refused")


class UnloadLoRAAdapterRequest(_Body):
    """`POST /v1/unload_lora_adapter` (vLLM's): stop serving `lora_name`."""

    lora_name: str = Field(min_length=1, description="the adapter's model id")
    lora_int_id: int | None = Field(None, description="vLLM's; ignored")
