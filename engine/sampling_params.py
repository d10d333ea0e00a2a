"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # most alternatives `logprobs` may ask for per token
MAX_LOGIT_BIAS = 100.0  # |bias| at most, as OpenAI
MAX_PRESENCE_FREQUENCY_PENALTY = 2.0  # |penalty| at most, as OpenAI
# Kept within [1/MAX, MAX] so that penalized logits stay finite through temperature.
MAX_REPETITION_PENALTY = 100.0


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A grammar the output must match, exactly one of: a JSON schema (serialized), any JSON
    object, a regular expression, one of several strings (`choice`), or a Lark grammar
    (llguidance's dialect, which takes vLLM's and most EBNF-style Lark grammars).

    `prefix_token_ids` were generated under this grammar before this request started (on a
    decode instance: the first token, sampled by prefill); the matcher consumes them first.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    prefix_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        given = [self.json, self.json_object or None, self.regex, self.choice, self.grammar]
        if sum(g is not None for g in given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice and "
                "grammar"
            )
        for name in ("json", "regex", "grammar"):
            if not isinstance(getattr(self, name), (str, type(None))):
                raise ValueError(f"structured outputs {name} must be a string")
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured outputs choice must be non-empty strings")

    @property
    def kind(self) -> str:
        """Which grammar this is: "json" (json_object too), "regex", "choice" or "grammar"."""
        if self.regex is not None:
            return "regex"
        if self.choice is not None:
            return "choice"
        return "grammar" if self.grammar is not None else "json"

    @property
    def source(self) -> str:
        """The grammar's text in its kind's language (choice: a regex of the alternatives;
        json_object: the schema of any object)."""
        if self.choice is not None:
            return "|".join(f"({re.escape(c)})" for c in self.choice)
        if self.json_object:
            return '{"type": "object"}'
        return self.json or self.regex or self.grammar or ""


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Mirrors vLLM's names."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filtering
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest one
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # Not None: the sampled token's log-probability and those of the `logprobs` likeliest.
    logprobs: int | None = None
    # Not None: each prompt token after the first gets its log-probability, its rank and the
    # `prompt_logprobs` likeliest at its position (the prompt then skips the prefix cache).
    prompt_logprobs: int | None = None
    # Penalties on tokens already seen: presence/frequency count output tokens only (OpenAI),
    # repetition counts prompt and output (vLLM's: positive logits divided, negative multiplied).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    skip_special_tokens: bool = True
    # With special tokens kept in the text: a space on each side of one (vLLM's default).
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrain to a grammar
    allowed_token_ids: list[int] | None = None  # not None: only these may be sampled
    # Words never generated: the last token of each is banned wherever the output already
    # ends with its other tokens. `bad_words_token_ids` holds their tokenizations (filled by
    # the input processor from `bad_words`, with and without a leading space).
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    truncate_prompt_tokens: int | None = None  # not None: keep only the prompt's last N tokens

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = dict(self.logit_bias or {})
        self.bad_words = list(self.bad_words)
        self.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self._check()
        self._check_penalties()
        self._check_token_lists()

    def _check(self) -> None:
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(
                f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}"
            )
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                f"got {self.prompt_logprobs}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")

    def _check_penalties(self) -> None:
        limit = MAX_PRESENCE_FREQUENCY_PENALTY
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -limit <= value <= limit:
                raise ValueError(f"{name} must be in [-{limit}, {limit}], got {value}")
        high = MAX_REPETITION_PENALTY
        if not _finite(self.repetition_penalty) or not 1 / high <= self.repetition_penalty <= high:
            raise ValueError(
                f"repetition_penalty must be in [{1 / high:g}, {high:g}], "
                f"got {self.repetition_penalty}"
            )
        for token_id, bias in self.logit_bias.items():
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise ValueError(
                    f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}"
                )
            if not _finite(bias) or abs(bias) > MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias} for token {token_id}"
                )

    def _check_token_lists(self) -> None:
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        allowed = self.allowed_token_ids
        if allowed is not None and (not allowed or not all(_token_id(t) for t in allowed)):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids")
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            raise ValueError("bad_words must be non-empty strings")
        if any(not ids or not all(_token_id(t) for t in ids) for ids in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must be non-empty lists of token ids")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (not _token_id(truncate) or truncate < 1):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, got {truncate}")

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs this request's token counts."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def _token_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
