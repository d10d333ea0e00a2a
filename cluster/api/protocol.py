"""OpenAI-compatible request bodies (pydantic, strict) and their mapping to SamplingParams.

Unknown fields are rejected with a 400 naming them; fields OpenAI clients commonly send
are accepted, and those whose non-default values we do not implement are refused clearly.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from cluster.api.beam_search import check_beam_search
from engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PRESENCE_FREQUENCY_PENALTY,
    MAX_REPETITION_PENALTY,
    SamplingParams,
    StructuredOutputsParams,
)

MAX_STOP_STRINGS = 8
MAX_SEED = 2**63 - 1
MAX_N = 128  # sequences (n, best_of) one prompt may sample
MAX_CACHE_SALT_CHARS = 1024
MAX_PRIORITY = 2**31 - 1  # |priority| at most

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Validation errors whose message is the whole story: the gateway shows it as is.
def unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_value", message)


def invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message)


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="send a last chunk carrying usage")


class TextFormat(_Body):
    type: Literal["text"]


class JSONObjectFormat(_Body):
    type: Literal["json_object"]


class JSONSchema(_Body):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$", description="the schema's name")
    description: str | None = Field(None, description="what the output is for")
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="the JSON schema the output matches; absent: any JSON"
    )
    strict: bool | None = Field(None, description="accepted: the output always follows the schema")


class JSONSchemaFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JSONSchema


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")
]


class _SamplingFields(_Body):
    """Fields shared by both endpoints (OpenAI's, plus vLLM's top_k/min_tokens/ignore_eos)."""

    model: str = Field(..., min_length=1, max_length=256, description="served model id")
    temperature: FiniteFloat | None = Field(None, ge=0, le=100, description="default 1.0")
    top_p: FiniteFloat | None = Field(None, gt=0, le=1, description="nucleus mass, default 1.0")
    top_k: int | None = Field(None, ge=-1, le=1_000_000, description="0 or -1: disabled")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="per-request sampling seed")
    stop: str | list[str] | None = Field(None, description="strings that end the output")
    stop_token_ids: list[int] | None = Field(None, max_length=64, description="token ids")
    min_tokens: int = Field(0, ge=0, le=1_000_000, description="tokens before EOS may stop")
    ignore_eos: bool = Field(False, description="keep generating past EOS")
    stream: bool = Field(False, description="server-sent events, ending with [DONE]")
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N, description="choices to return for each prompt")
    presence_penalty: FiniteFloat = Field(
        0.0,
        ge=-MAX_PRESENCE_FREQUENCY_PENALTY,
        le=MAX_PRESENCE_FREQUENCY_PENALTY,
        description="subtracted once from the logit of every token generated so far",
    )
    frequency_penalty: FiniteFloat = Field(
        0.0,
        ge=-MAX_PRESENCE_FREQUENCY_PENALTY,
        le=MAX_PRESENCE_FREQUENCY_PENALTY,
        description="subtracted from a token's logit once per time it was generated",
    )
    repetition_penalty: FiniteFloat = Field(
        1.0,
        ge=1 / MAX_REPETITION_PENALTY,
        le=MAX_REPETITION_PENALTY,
        description="vLLM's: on prompt and generated tokens, positive logits divided by it",
    )
    logit_bias: dict[str, FiniteFloat] | None = Field(
        None, description="token id -> bias in [-100, 100], added to its logit"
    )
    user: str | None = Field(None, max_length=256, description="ignored")
    response_format: ResponseFormat | None = Field(
        None, description="text (default), json_object, or json_schema: constrains the output"
    )
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="N: each prompt token's logprob and N likeliest"
    )
    use_beam_search: bool = Field(False, description="n beams, best by length-penalized score")
    length_penalty: FiniteFloat = Field(
        1.0, ge=-10, le=10, description="beam score: logprob sum / len**this"
    )

    @field_validator("prompt_logprobs")
    @classmethod
    def _check_prompt_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise unsupported("prompt_logprobs are not available with stream: true")
        return value

    @field_validator("use_beam_search")
    @classmethod
    def _check_beam_search(cls, value: bool, info: ValidationInfo) -> bool:
        return check_beam_search(value, info.data)

    cache_salt: str | None = Field(
        None,
        max_length=MAX_CACHE_SALT_CHARS,
        description="vLLM's: requests share cached prompt blocks only with requests of the "
        "same salt (a tenant's caches kept apart)",
    )
    priority: int = Field(
        0,
        ge=-MAX_PRIORITY,
        le=MAX_PRIORITY,
        description="vLLM's: lower runs first (scheduling_policy 'priority' only; else 0)",
    )

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, salt: str | None) -> str | None:
        if salt is not None and not salt:
            raise invalid("cache_salt must be a non-empty string if given")
        return salt

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.isascii() or not key.isdigit():
                raise invalid(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
            if abs(value) > MAX_LOGIT_BIAS:
                raise invalid(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {value} for token {key}"
                )
        return bias

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise invalid("stream_options is only allowed with stream: true")
        return options

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > 256 for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings")
        return stops

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError on combinations the engine refuses."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            structured_outputs=self.structured_outputs(),
            prompt_logprobs=self.prompt_logprobs,
        )

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar `response_format` asks for (its schema is checked by compiling it)."""
        fmt = self.response_format
        if isinstance(fmt, JSONObjectFormat):
            return StructuredOutputsParams(json_object=True)
        if isinstance(fmt, JSONSchemaFormat):
            return StructuredOutputsParams(json=json.dumps(fmt.json_schema.schema_ or {}))
        return None


class CompletionRequest(_SamplingFields):
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


class ImageURL(_Body):
    url: str = Field(..., min_length=1, description="data:image/...;base64,... (or allowed host)")
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDefinition(_Body):
    name: str = Field(..., pattern=FUNCTION_NAME, description="the function's name")
    description: str | None = Field(None, description="what it does, for the model")
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of its arguments")
    strict: bool | None = Field(None, description="accepted; forced calls follow the schema")


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str = Field(..., pattern=FUNCTION_NAME)


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Body):
    name: str = Field(..., pattern=FUNCTION_NAME)
    arguments: str = Field(..., description="the arguments as a JSON text")


class ToolCall(_Body):
    id: str = Field(..., max_length=256)
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
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


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=1024)
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias")
    max_completion_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    logprobs: bool = Field(False, description="return log-probabilities of sampled tokens")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="the N likeliest tokens too (with logprobs)"
    )
    tools: list[Tool] | None = Field(None, max_length=128, description="functions it may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default auto with tools; required or a named one forces a call"
    )

    @model_validator(mode="after")
    def _check_tool_choice(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or []]
        if choice not in (None, "none") and not names:
            raise invalid("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise invalid(f"tool_choice names {choice.function.name!r}, which is not in tools")
        if choice not in (None, "none", "auto") and self.response_format is not None:
            raise invalid("a forced tool call (tool_choice) cannot take a response_format too")
        return self

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


class TokenizeRequest(_Body):
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


class DetokenizeRequest(_Body):
    """`POST /detokenize` (vLLM's): token ids back to text, special tokens included."""

    model: str | None = Field(None, min_length=1, max_length=256, description="served model id")
    tokens: list[int] = Field(..., description="token ids of this model's vocabulary")


class ScaleRequest(_Body):
    """`POST /v1/admin/scale`: run `count` instances of `role` (adding, or draining the
    newest away)."""

    role: Literal["encoder", "prefill", "decode", "mixed"] = Field(description="the role to resize")
    count: int = Field(ge=0, le=64, description="instances of the role wanted")
