"""The body of `POST /v1/chat/completions`: messages, tools, and how the chat template renders
them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from pdcluster.cluster.api.messages import (
    ChatMessage,
    ImagePart,
    NamedToolChoice,
    Tool,
    invalid,
    template_messages,
    unsupported,
)
from pdcluster.cluster.api.protocol import SamplingFields
from pdcluster.engine.sampling_params import MAX_LOGPROBS


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=1024)
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias")
    max_completion_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    logprobs: bool = Field(False, description="return log-probabilities of sampled tokens")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="the N likeliest tokens too (with logprobs)"
    )
    tools: list[Tool] | None = Field(None, max_length=128, description="functions it may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default auto with tools; required or a named one forces a call "
        "(its schema wins over response_format, as in vLLM)",
    )  # fmt: skip
    parallel_tool_calls: bool = Field(True, description="false: at most one call returned")
    add_special_tokens: bool = Field(
        False, description="add BOS and the like to the rendered prompt (templates add theirs)"
    )
    add_generation_prompt: bool = Field(True, description="end the prompt with the reply's cue")
    continue_final_message: bool = Field(
        False, description="the reply continues the last message (without add_generation_prompt)"
    )
    chat_template: str | None = Field(
        None, min_length=1, max_length=1 << 16, description="a Jinja template used instead"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='variables for the template, e.g. {"enable_thinking": false}'
    )
    documents: list[dict[str, Any]] | None = Field(
        None, max_length=1024, description="RAG documents, passed to the template"
    )
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = Field(
        None, description="passed to the template"
    )
    modalities: list[str] | None = Field(None, description='output kinds: ["text"] only')

    @model_validator(mode="after")
    def _check_tool_choice(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or []]
        if choice not in (None, "none") and not names:
            raise invalid("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise invalid(f"tool_choice names {choice.function.name!r}, which is not in tools")
        return self

    @model_validator(mode="after")
    def _check_rendering(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid(
                "continue_final_message: cannot be true with add_generation_prompt (set it false)"
            )
        if any(m != "text" for m in self.modalities or []):
            other = next(m for m in self.modalities or [] if m != "text")
            raise unsupported(f"modalities: only text output is supported, not {other!r}")
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """The variables the chat template gets besides messages and tools: the request's
        chat_template_kwargs, with documents and reasoning_effort when sent."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.documents is not None:
            kwargs["documents"] = self.documents
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs

    def calls_tools(self) -> bool:
        """Whether the prompt offers the tools and the output is parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and not info.data.get("logprobs"):
            raise invalid("top_logprobs needs logprobs: true")
        return top_logprobs

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None, or how many alternatives each token comes with."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self, content_parts: bool = True) -> list[dict[str, Any]]:
        return template_messages(self.messages, content_parts)

    def image_urls(self) -> list[str]:
        return [
            p.image_url.url
            for m in self.messages
            if isinstance(m.content, list)
            for p in m.content
            if isinstance(p, ImagePart)
        ]
