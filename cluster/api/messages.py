"""Chat messages (text and image parts, an assistant's tool calls, a tool's answers), tool
definitions, and the base of every OpenAI request body.

Bodies follow the protocol the clients speak (vLLM's): a field we do not know is accepted
and kept in `model_extra`, and the gateway logs it as ignored; a known field with a value
we cannot honour is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError


class OpenAIBody(BaseModel):
    model_config = ConfigDict(extra="allow")


# Validation errors whose message is the whole story: the gateway shows it as is.
def unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_value", message)


def invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message)


class ImageURL(OpenAIBody):
    url: str = Field(..., min_length=1, description="data:image/...;base64,... (or allowed host)")
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(OpenAIBody):
    type: Literal["text"]
    text: str


class ImagePart(OpenAIBody):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDefinition(OpenAIBody):
    name: str = Field(..., pattern=FUNCTION_NAME, description="the function's name")
    description: str | None = Field(None, description="what it does, for the model")
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of its arguments")
    strict: bool | None = Field(None, description="accepted; forced calls follow the schema")


class Tool(OpenAIBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIBody):
    name: str = Field(..., pattern=FUNCTION_NAME)


class NamedToolChoice(OpenAIBody):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(OpenAIBody):
    name: str = Field(..., pattern=FUNCTION_NAME)
    arguments: str = Field(..., description="the arguments as a JSON text")


class ToolCall(OpenAIBody):
    id: str = Field(..., max_length=256)
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(OpenAIBody):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's earlier calls")
    tool_call_id: str | None = Field(None, max_length=256, description="a tool's answer to")

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise invalid(f"tool_calls: only an assistant message has them, not role {self.role!r}")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise invalid('tool_call_id: a message of role "tool" needs one, and only it')
        return self


def template_messages(
    messages: list[ChatMessage], content_parts: bool = True
) -> list[dict[str, Any]]:
    """Messages for the chat template: images become {"type": "image"} parts. For a
    template that takes string content only (`content_parts` False), text parts are
    joined by newlines into one string, and an image part is refused."""
    out = []
    for m in messages:
        content: Any = m.content
        if isinstance(content, list) and content_parts:
            content = [
                {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                for p in content
            ]
        elif isinstance(content, list):
            if not all(isinstance(p, TextPart) for p in content):
                raise ValueError("this model's chat template takes text content only")
            content = "\n".join(p.text for p in content)
        message: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = [_template_tool_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def _template_tool_call(call: ToolCall) -> dict[str, Any]:
    """Chat templates take a call's arguments as a mapping (transformers' convention)."""
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}
