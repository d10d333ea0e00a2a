"""The body of `POST /v1/admin/scale`."""

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
