"""The bodies of vLLM's `POST /tokenize` and `POST /detokenize`."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from pdcluster.cluster.api.messages import ChatMessage, OpenAIBody, invalid, template_messages


class TokenizeRequest(OpenAIBody):
    """`POST /tokenize` (vLLM's): a `prompt`, or chat `messages` rendered by the template."""

    model: str | None = Field(None, min_length=1, max_length=256, description="served model id")
    prompt: str | None = Field(None, description="text to tokenize")
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=1024)
    add_generation_prompt: bool = Field(True, description="messages: end with the reply's cue")
    add_special_tokens: bool | None = Field(
        None, description="add BOS and the like; default true for prompt, false for messages"
    )

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise invalid("give either prompt or messages")
        return self

    def template_messages(self, content_parts: bool = True) -> list[dict[str, Any]]:
        return template_messages(self.messages or [], content_parts)


class DetokenizeRequest(OpenAIBody):
    """`POST /detokenize` (vLLM's): token ids back to text, special tokens included."""

    model: str | None = Field(None, min_length=1, max_length=256, description="served model id")
    tokens: list[int] = Field(..., description="token ids of this model's vocabulary")
