"""The body of `POST /v1/completions`: a prompt (text or token ids, or a batch of either)."""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator

from pdcluster.cluster.api.messages import invalid, unsupported
from pdcluster.cluster.api.protocol import MAX_N, SamplingFields
from pdcluster.engine.sampling_params import MAX_LOGPROBS


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="text, token ids, or a batch of either"
    )
    max_tokens: int | None = Field(16, ge=1, description="tokens to generate at most")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="N: log-probability of each sampled token and of the N likeliest",
    )
    echo: bool = Field(False, description="prepend the prompt to the text (and its logprobs)")
    suffix: str | None = Field(None, description="not supported: empty only")
    best_of: int | None = Field(
        None,
        ge=1,
        le=MAX_N,
        description="sequences sampled per prompt (default n), of which the n with the highest "
        "cumulative log-probability are returned; not streamed when above n",
    )
    add_special_tokens: bool = Field(True, description="a text prompt gets BOS and the like")

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise unsupported("suffix is not supported")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of is not None and best_of < n:
            raise invalid(f"best_of ({best_of}) must be at least n ({n})")
        if best_of is not None and best_of > n and info.data.get("stream"):
            raise unsupported("best_of > n cannot be streamed (stream: false only)")
        return best_of

    def num_seqs(self) -> int:
        """Sequences sampled per prompt."""
        return self.best_of or self.n

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if not p or (isinstance(p, list) and any(not x for x in p)):
            raise ValueError("prompt must not be empty")
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # one prompt of token ids
        return list(p)
