"""A stream resumed on another instance after its own died (routing/handoff.py `resume`), in
one engine with no Ray: cut a request after some of its outputs reached the client, resume
it from those tokens and that text, and the client's concatenated stream equals an
undisturbed run's (seeded draws, penalties, logprobs, stop strings, grammars)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import pytest

from pdcluster.engine import LLM, SamplingParams, StructuredOutputsParams
from pdcluster.engine.request import Request
from pdcluster.routing.handoff import for_decode, for_prefill, resume
from tests.cluster_utils import SMALL_ENGINE

PROMPT = "Once upon a time, in a land far away"


@pytest.fixture(scope="module")
def llm(preset_dir):
    return LLM(preset_dir("tiny-llama"), **SMALL_ENGINE)


@dataclass
class Stream:
    """What a client got of one request."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def extend(self, other: Stream) -> Stream:
        return Stream(
            self.token_ids + other.token_ids,
            self.text + other.text,
            self.logprobs + other.logprobs,
            other.finish_reason,
        )


def run(llm: LLM, request: Request, cut_after: int | None = None) -> Stream:
    """Step `request` alone; with `cut_after`, abort it once that many tokens came out (its
    instance died), as a client sees it."""
    engine, got = llm.engine, Stream()
    engine.add_request(request)
    while engine.has_work():
        for out in engine.step()[0]:
            got.token_ids += out.new_token_ids
            got.text += out.new_text
            got.logprobs += out.new_logprobs or []
            got.finish_reason = out.finish_reason
        if cut_after is not None and len(got.token_ids) >= cut_after and engine.has_work():
            engine.abort_requests([request.request_id])
            assert got.finish_reason is None, "the request ended before the cut"
    assert all(b.ref_cnt == 0 for b in engine.scheduler.kv_cache_manager.block_pool.blocks)
    return got


def undisturbed_and_moved(
    llm: LLM, prompt, params: SamplingParams, cut_after: int
) -> tuple[Stream, Stream]:
    request = llm.processor.process("r", prompt, params)
    undisturbed = run(llm, llm.processor.process("u", prompt, params))
    before = run(llm, request, cut_after)
    after = run(llm, resume(request, "r~2", before.token_ids, before.text))
    return undisturbed, before.extend(after)


SAMPLED = SamplingParams(
    temperature=0.9, seed=7, max_tokens=24, ignore_eos=True, logprobs=2,
    frequency_penalty=1.2, presence_penalty=0.6, repetition_penalty=1.3,
)  # fmt: skip


@pytest.mark.parametrize("cut_after", [1, 5, 23])
def test_a_resumed_stream_is_the_undisturbed_one(llm, cut_after):
    """Seeded draws are a function of the position, and penalties count the tokens sent
    before as output (not prompt): the stream goes on as if nothing happened."""
    undisturbed, moved = undisturbed_and_moved(llm, PROMPT, SAMPLED, cut_after)
    assert moved.token_ids == undisturbed.token_ids and len(moved.token_ids) == 24
    assert moved.text == undisturbed.text
    assert moved.logprobs == pytest.approx(undisturbed.logprobs, abs=1e-4)
    assert moved.finish_reason == undisturbed.finish_reason == "length"


def test_the_earlier_tokens_count_as_output_for_penalties(llm):
    """As prompt tokens, a frequency penalty would miss them: the test tells the two apart
    (a bias makes one token likely; its penalty, counted on the output, makes it rare)."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = run(llm, llm.processor.process("g", PROMPT, greedy)).token_ids[0]
    params = dataclasses.replace(greedy, logit_bias={first: 6.0}, frequency_penalty=1.5)
    undisturbed, moved = undisturbed_and_moved(llm, PROMPT, params, 5)
    assert moved.token_ids == undisturbed.token_ids
    request = llm.processor.process("r", PROMPT, params)
    before = run(llm, request, 5)
    as_prompt = resume(request, "r~2", before.token_ids, before.text)
    as_prompt.num_prior_output_tokens, as_prompt.prior_output_text = 0, None
    assert before.token_ids + run(llm, as_prompt).token_ids != undisturbed.token_ids


def test_the_remaining_budget_and_the_grammar_go_on():
    grammar = StructuredOutputsParams(regex="[a-z]+", prefix_token_ids=(3,))
    params = SamplingParams(max_tokens=10, min_tokens=6, prompt_logprobs=1,
                            structured_outputs=grammar)  # fmt: skip
    request = Request("r", [1, 2], params, num_prior_output_tokens=0)
    moved = resume(request, "r~3", [7, 8, 9, 10], "abcd")
    p = moved.sampling_params
    assert (moved.request_id, moved.prompt_token_ids) == ("r~3", [1, 2, 7, 8, 9, 10])
    assert (moved.num_prior_output_tokens, moved.prior_output_text) == (4, "abcd")
    assert (p.max_tokens, p.min_tokens, p.prompt_logprobs) == (6, 2, None)
    assert p.structured_outputs.prefix_token_ids == (3, 7, 8, 9, 10)
    assert moved.kv_transfer_params is None
    nothing_sent = resume(request, "r~2", [], "")
    assert (nothing_sent.request_id, nothing_sent.prompt_token_ids) == ("r~2", [1, 2])
    assert nothing_sent.sampling_params == params


def stop_across(llm: LLM, params: SamplingParams) -> tuple[str, int]:
    """A stop string of two consecutive tokens' texts, and how many tokens come before it
    (neither text empty, and the string found nowhere earlier)."""
    plain = run(llm, llm.processor.process("plain", PROMPT, params))
    deltas = [llm.tokenizer.decode(plain.token_ids[: i + 1]) for i in range(len(plain.token_ids))]
    deltas = [b[len(a) :] for a, b in zip(["", *deltas], deltas)]
    for k in range(3, len(deltas) - 1):
        stop = deltas[k] + deltas[k + 1]
        if deltas[k].strip() and deltas[k + 1].strip() and stop not in "".join(deltas[: k + 1]):
            return stop, k
    raise AssertionError("no usable stop string in the output")


def test_a_stop_string_across_the_move_and_text_held_back(llm):
    """The dead instance held back the text that could start the stop string: it comes from
    the new one, which also finds the stop string across the move."""
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    stop, k = stop_across(llm, greedy)
    params = dataclasses.replace(greedy, stop=[stop])
    undisturbed, moved = undisturbed_and_moved(llm, PROMPT, params, k + 1)
    assert undisturbed.finish_reason == "stop" and stop not in undisturbed.text
    assert (moved.token_ids, moved.text) == (undisturbed.token_ids, undisturbed.text)
    assert moved.finish_reason == "stop"
    request = llm.processor.process("r", PROMPT, params)
    before = run(llm, request, k + 1)
    assert not undisturbed.text.startswith(before.text + stop[:1])  # it was held back
    unknown = resume(request, "r~2", before.token_ids, before.text)
    unknown.prior_output_text = None  # decoded as context: the stop string is missed
    assert run(llm, unknown).finish_reason == "length"


def test_a_grammar_resumes_from_the_text_so_far(llm):
    schema = {"type": "object", "properties": {"a": {"enum": ["yes", "no"]}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    grammar = StructuredOutputsParams(json=json.dumps(schema))
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=grammar)
    undisturbed, moved = undisturbed_and_moved(llm, "JSON please:", params, 3)
    assert (moved.token_ids, moved.text) == (undisturbed.token_ids, undisturbed.text)
    assert moved.finish_reason == undisturbed.finish_reason == "stop"
    assert json.loads(moved.text)["a"] in ("yes", "no")


def test_a_resumed_request_hands_off_from_p_to_d_with_its_text(llm):
    """Re-planned on P and D: P keeps the earlier output (penalties), and D goes on from all
    the text sent, P's first token's included."""
    request = llm.processor.process("r", PROMPT, SAMPLED)
    moved = resume(request, "r~2", [11, 12], "ab")
    on_p = for_prefill(moved)
    assert (on_p.num_prior_output_tokens, on_p.prior_output_text) == (2, "ab")
    on_d = for_decode(moved, 13, {}, "c")
    assert (on_d.num_prior_output_tokens, on_d.prior_output_text) == (3, "abc")
    assert on_d.sampling_params.max_tokens == SAMPLED.max_tokens - 3
    plain = for_decode(request, 13, {}, "c")  # not resumed: text as before
    assert (plain.num_prior_output_tokens, plain.prior_output_text) == (1, None)
