"""Structured outputs: grammars compiled with llguidance, one matcher per request, and the
bitmask of tokens each row of a step may sample.

A grammar is compiled once per schema and cached; each request gets a copy of the compiled
matcher (microseconds), which advances on every token the request samples.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from functools import cached_property

import llguidance
import torch

from pdcluster.engine.sampling_params import StructuredOutputsParams
from pdcluster.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 128
# `json.dumps` spacing with no other whitespace: models write it naturally, and a model
# cannot stall in an endless run of whitespace between tokens.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompiler:
    """Compiles and caches the grammars of one vocabulary. Thread-safe: a gateway validates
    from worker threads, an engine compiles from its step thread."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width, padded rows included
        # (kind, source) -> the compiled matcher, least recently used first
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @cached_property
    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        # About 0.2 s for a 49k vocabulary: built on the first structured request.
        return llguidance.LLTokenizer(
            self._tokenizer.to_json(),
            n_vocab=self.vocab_size,
            eos_token=self._tokenizer.eos_token_ids,
        )

    @cached_property
    def _executor(self) -> llguidance.LLExecutor:
        return llguidance.LLExecutor()

    def matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher that has consumed `params.prefix_token_ids`. ValueError when the
        schema does not compile or the prefix does not match it."""
        matcher = self._compile(params.kind, params.source).deep_copy()
        if params.prefix_token_ids and not matcher.consume_tokens(list(params.prefix_token_ids)):
            raise ValueError(f"generated tokens do not match the grammar: {matcher.get_error()}")
        return matcher

    def _compile(self, kind: str, source: str) -> llguidance.LLMatcher:
        key = (kind, source)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        what = _WHAT[kind]
        try:
            grammar = _grammar(kind, source)
        except ValueError as exc:
            raise ValueError(f"invalid {what}: {exc}") from None
        compiled = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if compiled.is_error():
            raise ValueError(f"invalid {what}: {compiled.get_error()}")
        with self._lock:
            self._compiled[key] = compiled
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def bitmask(
        self,
        matchers: Sequence[llguidance.LLMatcher | None],
        drafted: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor | None:
        """Allowed tokens of each row, one bit per token: [num_rows, ceil(vocab / 32)] int32.
        A row without a live matcher allows every token; None when no row has one.

        `drafted[i]`: draft tokens row i follows (a verified position after them): its mask
        is its matcher's after them, the matcher rolled back after. A row whose drafts the
        grammar refuses, or completes before their end, allows every token: its sample is
        never used, since the row before it cannot accept the refused draft and a complete
        grammar ends the request."""
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None and not m.is_stopped()]
        if not rows:
            return None
        num_words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(matchers), num_words), -1, dtype=torch.int32)
        now = [(m, i) for m, i in rows if not (drafted and drafted[i])]
        if now:
            self._executor.unsafe_compute_mask_ptr(
                now, bitmask.data_ptr(), num_words * 4, len(matchers)
            )
        for m, i in rows:
            if drafted and drafted[i]:
                self._fill_after(m, list(drafted[i]), bitmask, i)
        return bitmask

    def _fill_after(
        self, matcher: llguidance.LLMatcher, tokens: list[int], bitmask: torch.Tensor, row: int
    ) -> None:
        """Row `row` of `bitmask` [num_rows, words]: the matcher's mask after `tokens`."""
        num_consumed = matcher.try_consume_tokens(tokens)
        try:
            if num_consumed == len(tokens) and not matcher.is_stopped():
                num_words = bitmask.shape[1]
                self._executor.unsafe_compute_mask_ptr(
                    [(matcher, row)], bitmask.data_ptr(), num_words * 4, bitmask.shape[0]
                )
        finally:
            matcher.rollback(num_consumed)


_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _grammar(kind: str, source: str) -> str:
    """llguidance's grammar of a StructuredOutputsParams' kind and source."""
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_LAYOUT)
    if kind in ("regex", "choice"):
        return llguidance.LLMatcher.grammar_from_regex(source)
    return llguidance.LLMatcher.grammar_from_lark(source)


def advance(matcher: llguidance.LLMatcher, token_id: int) -> bool:
    """Consume a sampled token; True when the grammar is complete (or, never expected under
    the mask, the token broke it: the request ends rather than run unconstrained)."""
    if not matcher.consume_token(token_id):
        logger.warning("token %d broke the grammar: %s", token_id, matcher.get_error())
        return True
    return matcher.is_stopped()
