"""Beam search as vLLM serves it, the search itself (no cluster, no HTTP here).

Each step expands every live beam by one token: its candidates are the 2 x beam_width likeliest
next tokens (from one max_tokens=1 request per beam, see `cluster.api.beam_serving`). A
candidate ending in EOS (or a stop token id, or completing a stop string) finishes; the others
are ranked and the best beam_width stay live. After max_tokens steps the live beams finish
too ("length"), and all finished beams are ranked by their length-penalized score.

Ranking (vLLM's `get_beam_search_score`): cumulative logprob / seq_len ** length_penalty,
where seq_len counts the prompt and the generated tokens, less a final EOS. A positive
length_penalty thus favours longer beams, 0 ranks by cumulative logprob alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic_core import PydanticCustomError

from pdcluster.engine.outputs import TopLogprobs
from pdcluster.engine.sampling_params import MAX_LOGPROBS

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam asks for 2 x beam_width alternatives


def check_beam_search(use_beam_search: bool, fields: dict[str, Any]) -> bool:
    """Request-body rule: beam search is not streamed, and `n` is its width."""
    if not use_beam_search:
        return False
    if fields.get("stream"):
        raise PydanticCustomError(
            "unsupported_value", "use_beam_search cannot be streamed (stream: false only)"
        )
    if fields.get("n", 1) > MAX_BEAM_WIDTH:
        raise PydanticCustomError(
            "invalid_value",
            f"use_beam_search takes n (the beam width) up to {MAX_BEAM_WIDTH}, got {fields['n']}",
        )
    if fields.get("response_format") is not None:
        raise PydanticCustomError(
            "unsupported_value", "use_beam_search cannot take a response_format"
        )
    return True


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    num_prompt_tokens: int
    eos_token_ids: frozenset[int]  # finish a beam (empty with ignore_eos)
    stop_token_ids: frozenset[int] = frozenset()  # finish it too, named as its stop_reason
    stop: tuple[str, ...] = ()  # stop strings, checked on a beam's text
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    # Until this many tokens are out, EOS and stop token ids are no candidates and no stop
    # string ends a beam (vLLM's min_tokens).
    min_tokens: int = 0

    @property
    def num_candidates(self) -> int:
        """Alternatives each beam's expansion asks for."""
        return 2 * self.beam_width


@dataclass
class Beam:
    """One hypothesis: its generated tokens and their log-probabilities."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    text: str = ""  # set once finished (and while stop strings are checked)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def extended(self, token_id: int, logprob: float, top: TopLogprobs) -> Beam:
        return Beam(
            [*self.token_ids, token_id],
            [*self.logprobs, logprob],
            [*self.top_logprobs, top],
            self.cumulative_logprob + logprob,
        )


def beam_score(beam: Beam, params: BeamSearchParams) -> float:
    """The length-penalized score finished beams are ranked by (see the module doc)."""
    seq_len = params.num_prompt_tokens + len(beam.token_ids)
    if beam.token_ids and beam.token_ids[-1] in params.eos_token_ids:
        seq_len -= 1
    return beam.cumulative_logprob / seq_len**params.length_penalty


class BeamSearch:
    """The live and finished beams of one prompt. `decode` turns generated token ids into
    text (special tokens skipped as the request asks)."""

    def __init__(self, params: BeamSearchParams, decode: Callable[[list[int]], str]) -> None:
        self.params = params
        self.decode = decode
        self.live: list[Beam] = [Beam()]
        self.finished: list[Beam] = []
        self.num_steps = 0

    @property
    def done(self) -> bool:
        return not self.live or self.num_steps >= self.params.max_tokens

    def step(self, tops: list[TopLogprobs]) -> None:
        """Expand live beam i by its alternatives `tops[i]`; keep the best beam_width."""
        candidates: list[Beam] = []
        k = self.params.num_candidates
        for beam, top in zip(self.live, tops):
            for token_id, logprob in zip(top.token_ids[:k], top.logprobs[:k]):
                if self._too_early(token_id, len(beam.token_ids)):
                    continue
                candidate = beam.extended(token_id, logprob, top)
                if self._finishes(candidate):
                    self.finished.append(candidate)
                else:
                    candidates.append(candidate)
        candidates.sort(key=lambda b: beam_score(b, self.params), reverse=True)
        self.live = candidates[: self.params.beam_width]
        self.num_steps += 1

    def _too_early(self, token_id: int, num_tokens: int) -> bool:
        p = self.params
        stops = token_id in p.eos_token_ids or token_id in p.stop_token_ids
        return stops and num_tokens < p.min_tokens

    def _finishes(self, beam: Beam) -> bool:
        """Sets the finish reason (and text, with stop strings) of a beam that ends here."""
        p = self.params
        token_id = beam.token_ids[-1]
        if token_id in p.eos_token_ids:
            beam.finish_reason = "stop"
        elif token_id in p.stop_token_ids:
            beam.finish_reason, beam.stop_reason = "stop", token_id
        elif p.stop and len(beam.token_ids) >= p.min_tokens:
            beam.text = self.decode(beam.token_ids)
            hits = [(beam.text.find(s), s) for s in p.stop if s in beam.text]
            if hits:
                at, stop = min(hits)
                beam.text = beam.text[: at + len(stop) if p.include_stop_str_in_output else at]
                beam.finish_reason, beam.stop_reason = "stop", stop
        return beam.finish_reason is not None

    def best(self) -> list[Beam]:
        """The beam_width best finished beams (the live ones finish as "length"), best
        first, with their texts."""
        for beam in self.live:
            beam.finish_reason = "length"
        ranked = sorted(
            [*self.finished, *self.live], key=lambda b: beam_score(b, self.params), reverse=True
        )[: self.params.beam_width]
        for beam in ranked:
            if not isinstance(beam.stop_reason, str):  # else cut at its stop string already
                on_token = beam.finish_reason == "stop"  # EOS or a stop token id: not in text
                beam.text = self.decode(beam.token_ids[:-1] if on_token else beam.token_ids)
        return ranked
