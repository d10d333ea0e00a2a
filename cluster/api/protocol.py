"""The fields both generating endpoints share (OpenAI's, and vLLM's on top) and their mapping
to SamplingParams. The bodies: completions_protocol.py, chat_protocol.py, tokens_protocol.py,
admin_protocol.py and responses_protocol.py.

As vLLM's, the bodies accept any field: one we do not know, or one that means nothing on
this server (`NO_OP_FIELDS`), is listed by `ignored_fields` (the gateway logs them); a known
field with a value we cannot honour is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from pdcluster.cluster.api.beam_search import check_beam_search
from pdcluster.cluster.api.messages import OpenAIBody, invalid, unsupported
from pdcluster.cluster.api.output_format import (
    JSONObjectFormat,
    JSONSchemaFormat,
    ResponseFormat,
    StructuredOutputs,
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


class StreamOptions(OpenAIBody):
    include_usage: bool = Field(False, description="send a last chunk carrying usage")
    continuous_usage_stats: bool = Field(
        False, description="vLLM's: usage so far in every chunk too"
    )


class SamplingFields(OpenAIBody):
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
    def _one_grammar_field(self) -> SamplingFields:
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
