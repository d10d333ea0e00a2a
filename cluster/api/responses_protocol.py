"""The request body of `POST /v1/responses` (OpenAI's Responses API) and its translation into
the chat request that the shared serving path runs.

A response is stateless here: every turn travels in `input` (messages, earlier
`function_call` items and their `function_call_output`s). Fields that mean nothing on a
server that keeps no state (`store`, `metadata`, `user`, ...) are accepted and ignored;
fields that would need stored state (`previous_response_id`, `background`) are a 400 that
says so. Unknown fields are accepted and logged, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pdcluster.cluster.api.chat_protocol import ChatCompletionRequest
from pdcluster.cluster.api.messages import (
    FUNCTION_NAME,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    ImagePart,
    ImageURL,
    NamedToolChoice,
    TextPart,
    Tool,
    ToolCall,
    invalid,
    unsupported,
)
from pdcluster.cluster.api.output_format import (
    JSONObjectFormat,
    JSONSchema,
    JSONSchemaFormat,
    ResponseFormat,
    TextFormat,
)
from pdcluster.cluster.api.protocol import FiniteFloat

MAX_INPUT_ITEMS = 1024
MAX_METADATA_PAIRS = 16


class _Part(BaseModel):
    """An input item or part: strict, as the chat messages it becomes."""

    model_config = ConfigDict(extra="forbid")


class InputText(_Part):
    type: Literal["input_text"]
    text: str


class OutputText(_Part):
    """An assistant message's text, as an earlier response returned it."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list, description="ignored")
    logprobs: list[Any] | None = Field(None, description="ignored")


class InputImage(_Part):
    type: Literal["input_image"]
    image_url: str | None = Field(None, min_length=1, description="a data: URL (or allowed host)")
    file_id: str | None = Field(None, description="not supported: no files are stored")
    detail: Literal["auto", "low", "high"] = "auto"

    @model_validator(mode="after")
    def _check_source(self) -> InputImage:
        if self.file_id is not None:
            raise unsupported("file_id is not supported: no files are stored; send image_url")
        if self.image_url is None:
            raise invalid("image_url: an input_image needs one")
        return self


InputPart = Annotated[InputText | OutputText | InputImage, Field(discriminator="type")]


class Message(_Part):
    """A turn; `id` and `status` come with assistant messages echoed from an earlier
    response's output."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputPart]
    id: str | None = Field(None, max_length=256, description="ignored")
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(_Part):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1, max_length=256)
    name: str = Field(..., pattern=FUNCTION_NAME)
    arguments: str = Field(..., description="the arguments as a JSON text")
    id: str | None = Field(None, max_length=256, description="ignored")
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutput(_Part):
    """The caller's answer to a `function_call` (matched by `call_id`)."""

    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1, max_length=256)
    output: str | list[InputText]
    id: str | None = Field(None, max_length=256, description="ignored")
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(item: Any) -> str | None:
    """A message may leave out its `type` (OpenAI's "easy input message")."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[Message, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")],
    Discriminator(_item_type),
]


class FunctionTool(FunctionDefinition):
    """The Responses API's function tool: chat's definition, without the `function` wrapper."""

    type: Literal["function"]


class FunctionToolChoice(_Part):
    type: Literal["function"]
    name: str = Field(..., pattern=FUNCTION_NAME)


class JSONSchemaTextFormat(JSONSchema):
    """`text.format` of type json_schema: chat's `json_schema`, without the wrapper."""

    type: Literal["json_schema"]


class TextConfig(_Part):
    format: Annotated[
        TextFormat | JSONObjectFormat | JSONSchemaTextFormat, Field(discriminator="type")
    ] = Field(default_factory=lambda: TextFormat(type="text"), description="the output's form")


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`."""

    model_config = ConfigDict(extra="allow")  # unknown fields: ignored and logged

    model: str = Field(..., min_length=1, max_length=256, description="served model id")
    input: str | list[InputItem] = Field(
        ..., description="the prompt: a text (one user message) or the conversation's items"
    )
    instructions: str | None = Field(None, description="a system message put first")
    max_output_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    temperature: FiniteFloat | None = Field(None, ge=0, le=2, description="default 1.0")
    top_p: FiniteFloat | None = Field(None, gt=0, le=1, description="nucleus mass, default 1.0")
    stream: bool = Field(False, description="server-sent Responses events")
    tools: list[FunctionTool] | None = Field(None, max_length=128, description="functions")
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = Field(
        None, description="default auto with tools; required or a named one forces a call"
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call")
    text: TextConfig | None = Field(None, description="format: text, json_object, json_schema")
    truncation: Literal["disabled", "auto"] | None = Field(
        None, description='only "disabled": input beyond the context is a 400'
    )
    include: list[str] | None = Field(None, description="extra output data: none supported")
    previous_response_id: str | None = Field(None, description="not supported: nothing stored")
    conversation: str | dict[str, Any] | None = Field(None, description="not supported")
    prompt: dict[str, Any] | None = Field(None, description="not supported: a stored prompt")
    background: bool | None = Field(None, description="not supported: nothing stored")
    store: bool | None = Field(None, description="ignored: nothing is stored")
    metadata: dict[str, str] | None = Field(
        None, max_length=MAX_METADATA_PAIRS, description="ignored; echoed in the response"
    )
    user: str | None = Field(None, max_length=256, description="ignored")
    service_tier: str | None = Field(None, max_length=64, description="ignored")
    safety_identifier: str | None = Field(None, max_length=256, description="ignored")
    prompt_cache_key: str | None = Field(None, max_length=256, description="ignored")

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: str | list[Any]) -> str | list[Any]:
        if not value:
            raise invalid("input must not be empty")
        if isinstance(value, list) and len(value) > MAX_INPUT_ITEMS:
            raise invalid(f"input takes at most {MAX_INPUT_ITEMS} items, got {len(value)}")
        return value

    @field_validator("previous_response_id", "conversation", "prompt")
    @classmethod
    def _check_stored(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise unsupported(
                f"{info.field_name} is not supported: this server stores no responses, "
                "conversations or prompts; send the earlier turns (and their output items) "
                "in input"
            )
        return value

    @field_validator("background")
    @classmethod
    def _check_background(cls, value: bool | None) -> bool | None:
        if value:
            raise unsupported("background is not supported: this server stores no responses")
        return value

    @field_validator("truncation")
    @classmethod
    def _check_truncation(cls, value: str | None) -> str | None:
        if value == "auto":
            raise unsupported('truncation "auto" is not supported: only "disabled"')
        return value

    @field_validator("include")
    @classmethod
    def _check_include(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise unsupported(f"include: {value[0]!r} is not supported (no extra output data)")
        return value

    def ignored_fields(self) -> list[str]:
        """Fields of the body that are no part of this API, which the request ignores."""
        return sorted(self.model_extra or {})

    def text_format(self) -> dict[str, Any]:
        return (self.text or TextConfig()).format.model_dump(by_alias=True, exclude_none=True)

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as a chat completion (raises pydantic's ValidationError on a
        tool_choice the tools do not allow)."""
        return ChatCompletionRequest(
            model=self.model,
            messages=self.messages(),
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            tools=[_chat_tool(t) for t in self.tools] if self.tools is not None else None,
            tool_choice=_chat_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls is not False,
            response_format=self._response_format(),
        )

    def messages(self) -> list[ChatMessage]:
        """`instructions` as a system message, then `input`'s items as chat messages: a
        developer message is a system one, function calls join the assistant turn they
        follow, and their outputs are tool messages."""
        messages = [ChatMessage(role="system", content=self.instructions)]
        if self.instructions is None:
            messages = []
        items = [Message(role="user", content=self.input)] if isinstance(self.input, str) else []
        for item in items or self.input:
            if isinstance(item, Message):
                role = "system" if item.role == "developer" else item.role
                messages.append(ChatMessage(role=role, content=_chat_content(item.content)))
            elif isinstance(item, FunctionCallItem):
                _add_call(messages, item)
            else:
                content = _chat_content(item.output)
                messages.append(
                    ChatMessage(role="tool", tool_call_id=item.call_id, content=content)
                )
        return messages

    def _response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, JSONSchemaTextFormat):
            schema = JSONSchema.model_validate(fmt.model_dump(exclude={"type"}, by_alias=True))
            return JSONSchemaFormat(type="json_schema", json_schema=schema)
        return fmt if isinstance(fmt, JSONObjectFormat) else None


def _chat_content(content: str | list[Any]) -> str | list[ContentPart]:
    if isinstance(content, str):
        return content
    return [_chat_part(part) for part in content]


def _chat_part(part: InputText | OutputText | InputImage) -> ContentPart:
    if isinstance(part, InputImage):
        url = ImageURL(url=part.image_url or "", detail=part.detail)
        return ImagePart(type="image_url", image_url=url)
    return TextPart(type="text", text=part.text)


def _add_call(messages: list[ChatMessage], item: FunctionCallItem) -> None:
    """A function call joins the assistant message just before it (calls made in one turn
    render as one assistant turn), or starts one."""
    call = ToolCall(
        id=item.call_id,
        type="function",
        function=FunctionCall(name=item.name, arguments=item.arguments),
    )
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant" and last.tool_calls is not None:
        last.tool_calls.append(call)
    elif last is not None and last.role == "assistant":
        last.tool_calls = [call]
    else:
        messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))


def _chat_tool(tool: FunctionTool) -> Tool:
    return Tool(type="function", function=FunctionDefinition(**tool.model_dump(exclude={"type"})))


def _chat_tool_choice(
    choice: str | FunctionToolChoice | None,
) -> str | NamedToolChoice | None:
    if isinstance(choice, FunctionToolChoice):
        return NamedToolChoice(type="function", function=FunctionName(name=choice.name))
    return choice
