"""OpenAI-compatible request bodies, vLLM's fields included, and their mapping to
SamplingParams.

As vLLM's, the bodies accept any field: one we do not know, or one that means nothing on
this server (`NO_OP_FIELDS`), is listed by `ignored_fields` (the gateway logs them); a known
field with a value we cannot honour is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pdcluster.cluster.api.beam_search import check_beam_search
from pdcluster.cluster.api.messages import (
    ChatMessage,
    ImagePart,
    NamedToolChoice,
    OpenAIBody,
    Tool,
    invalid,
    template_messages,
    unsupported,
)
from pdcluster.engine.sampling_params import (
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


# Fields a client may send that mean nothing on a self-hosted server: accepted and ignored.
NO_OP_FIELDS = (
    "user", "store", "metadata", "service_tier", "mm_processor_kwargs", "vllm_xargs", "modalities"
)  # fmt: skip


class _Body(BaseModel):
    """Our own (non-OpenAI) bodies: a typo is a 400."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(OpenAIBody):
    include_usage: bool = Field(False, description="send a last chunk carrying usage")
    continuous_usage_stats: bool = Field(
        False, description="vLLM's: usage so far in every chunk too"
    )


class TextFormat(OpenAIBody):
    type: Literal["text"]


class JSONObjectFormat(OpenAIBody):
    type: Literal["json_object"]


class JSONSchema(OpenAIBody):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$", description="the schema's name")
    description: str | None = Field(None, description="what the output is for")
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="the JSON schema the output matches; absent: any JSON"
    )
    strict: bool | None = Field(None, description="accepted: the output always follows the schema")


class JSONSchemaFormat(OpenAIBody):
    type: Literal["json_schema"]
    json_schema: JSONSchema


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")
]


class StructuredOutputs(OpenAIBody):
    """vLLM's `structured_outputs`: exactly one grammar the output must match."""

    json_: dict[str, Any] | str | None = Field(
        None, alias="json", description="a JSON schema (an object, or its text)"
    )
    regex: str | None = Field(None, min_length=1, description="a regular expression")
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, max_length=1024, description="the output is one of these strings"
    )
    grammar: str | None = Field(None, min_length=1, description="a Lark grammar")
    json_object: bool | None = Field(None, description="true: any JSON object")

    @model_validator(mode="after")
    def _one_grammar(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k)]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise invalid(
                "structured_outputs: give exactly one of json, regex, choice, grammar and "
                f"json_object (got {', '.join(g.rstrip('_') for g in given) or 'none'})"
            )
        return self

    def params(self) -> StructuredOutputsParams:
        schema = self.json_
        return StructuredOutputsParams(
            json=json.dumps(schema) if isinstance(schema, dict) else schema,
            json_object=bool(self.json_object),
            regex=self.regex,
            choice=tuple(self.choice) if self.choice is not None else None,
            grammar=self.grammar,
        )


class _SamplingFields(OpenAIBody):
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

    min_p: FiniteFloat = Field(
        0.0, ge=0, le=1, description="drop tokens less likely than min_p times the likeliest"
    )
    bad_words: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(
        None, max_length=64, description="words never generated"
    )
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, max_length=1_000_000, description="only these tokens may be sampled"
    )
    include_stop_str_in_output: bool = Field(False, description="keep the stop string matched")
    skip_special_tokens: bool = Field(True, description="leave special tokens out of the text")
    spaces_between_special_tokens: bool = Field(
        True, description="special tokens kept in the text have a space on each side"
    )
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="keep only the prompt's last N tokens (-1: the context length)"
    )
    return_tokens_as_token_ids: bool = Field(
        False, description='logprob tokens as "token_id:N" instead of their text'
    )
    request_id: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="names the request in the response id and the logs (X-Request-Id wins)",
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's: json, regex, choice or grammar the output matches"
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="structured_outputs.json")
    guided_regex: str | None = Field(None, min_length=1, description="structured_outputs.regex")
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, description="structured_outputs.choice"
    )
    guided_grammar: str | None = Field(None, min_length=1, description="structured_outputs.grammar")
    store: bool | None = Field(None, description="ignored: nothing is stored")
    metadata: dict[str, Any] | None = Field(None, description="ignored")
    service_tier: str | None = Field(None, description="ignored: one tier")
    mm_processor_kwargs: dict[str, Any] | None = Field(
        None, description="ignored: images are preprocessed with the model's own settings"
    )
    vllm_xargs: dict[str, Any] | None = Field(None, description="ignored: no plugins here")

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
            structured_outputs=self.grammar()[1],
            min_p=self.min_p,
            bad_words=list(self.bad_words or []),
            allowed_token_ids=self.allowed_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            prompt_logprobs=self.prompt_logprobs,
        )

    def grammar(self) -> tuple[str | None, StructuredOutputsParams | None]:
        """(the field that asked, the grammar) of the output, from response_format,
        structured_outputs or a guided_* alias (its schema is checked by compiling it)."""
        fmt = self.response_format
        if isinstance(fmt, JSONObjectFormat):
            return "response_format", StructuredOutputsParams(json_object=True)
        if isinstance(fmt, JSONSchemaFormat):
            schema = json.dumps(fmt.json_schema.schema_ or {})
            return "response_format", StructuredOutputsParams(json=schema)
        if self.structured_outputs is not None:
            return "structured_outputs", self.structured_outputs.params()
        for kind in _GUIDED:
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                return f"guided_{kind}", StructuredOutputs.model_validate({kind: value}).params()
        return None, None

    @model_validator(mode="after")
    def _one_grammar_field(self) -> _SamplingFields:
        asked = ["structured_outputs"] * (self.structured_outputs is not None)
        asked += [f"guided_{k}" for k in _GUIDED if getattr(self, f"guided_{k}") is not None]
        if isinstance(self.response_format, (JSONObjectFormat, JSONSchemaFormat)):
            asked.append("response_format")
        if len(asked) > 1:
            raise invalid(f"{asked[1]}: only one of {', '.join(asked)} may constrain the output")
        if asked and self.use_beam_search:
            raise unsupported(f"use_beam_search cannot take a {asked[0]}")
        return self

    def prompt_truncation(self, max_model_len: int) -> int | None:
        """SamplingParams.truncate_prompt_tokens: -1 is the context length, more than it a
        ValueError (as vLLM)."""
        n = self.truncate_prompt_tokens
        if n is not None and n > max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens ({n}) exceeds this model's maximum context length "
                f"({max_model_len} tokens)"
            )
        return max_model_len if n == -1 else n

    def ignored_fields(self) -> list[str]:
        """Fields this server does not act on: the no-op ones sent, and every unknown one
        (at any depth, dotted)."""
        return [f for f in NO_OP_FIELDS if f in self.model_fields_set] + unknown_fields(self)


_GUIDED = ("json", "regex", "choice", "grammar")


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The fields of `model` and of the models inside it that no model declares, dotted."""
    found = [prefix + key for key in model.model_extra or {}]
    for name in model.model_fields_set:
        found += _unknown_in(getattr(model, name), f"{prefix}{name}")
    return found


def _unknown_in(value: Any, path: str) -> list[str]:
    if isinstance(value, BaseModel):
        return unknown_fields(value, path + ".")
    if isinstance(value, list):
        return [f for i, item in enumerate(value) for f in _unknown_in(item, f"{path}.{i}")]
    return []


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
        asked = self.grammar()[0]
        if choice not in (None, "none", "auto") and asked is not None:
            raise invalid(f"a forced tool call (tool_choice) cannot take a {asked} too")
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


class ScaleRequest(_Body):
    """`POST /v1/admin/scale`: run `count` instances of `role` (adding, or draining the
    newest away)."""

    role: Literal["encoder", "prefill", "decode", "mixed"] = Field(description="the role to resize")
    count: int = Field(ge=0, le=64, description="instances of the role wanted")
