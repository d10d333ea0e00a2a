"""vLLM's sampling fields in the engine, without Ray: min_p, allowed_token_ids, bad_words,
special tokens in the text, prompt truncation, and regex / choice / Lark grammars."""

from __future__ import annotations

import re

import pytest
import torch

from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.llm import new_request_output
from pdcluster.engine.sampler import sample
from pdcluster.engine.sampling_params import StructuredOutputsParams
from pdcluster.engine.token_masks import banned_by_bad_words
from pdcluster.routing.handoff import for_decode, for_prefill
from tests.cluster_utils import SMALL_ENGINE

PROMPTS = ["The quick brown fox", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(preset_dir):
    return LLM(preset_dir("tiny-llama"), **SMALL_ENGINE)


def greedy(**fields) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 12, "ignore_eos": True, **fields})


def blocks_all_free(llm: LLM) -> bool:
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_usable_blocks


def test_min_p_samples_only_tokens_near_the_likeliest():
    probs = torch.tensor([0.40, 0.30, 0.18, 0.12])  # min_p 0.5 keeps >= 0.20: tokens 0 and 1
    logits = probs.log().repeat(400, 1)
    params = [SamplingParams(temperature=1.0, min_p=0.5)] * 400
    generators = [torch.Generator().manual_seed(i) for i in range(400)]
    drawn = set(sample(logits.clone(), params, generators).token_ids)
    assert drawn == {0, 1}
    unfiltered = [SamplingParams(temperature=1.0)] * 400
    assert set(sample(logits.clone(), unfiltered, generators).token_ids) == {0, 1, 2, 3}


def test_allowed_token_ids_confine_their_row_only(llm):
    plain = llm.generate(PROMPTS, greedy())
    allowed = [5, 17, 300, 1000]
    sampled = SamplingParams(max_tokens=24, seed=1, allowed_token_ids=allowed)
    outs = llm.generate(PROMPTS, [sampled, greedy()])
    assert set(outs[0].token_ids) <= set(allowed) and len(set(outs[0].token_ids)) > 1
    assert outs[1].token_ids == plain[1].token_ids  # the other row of the batch is untouched
    assert blocks_all_free(llm)


def test_bad_words_ban_single_tokens_and_sequences(llm):
    plain = llm.generate(PROMPTS[0], greedy())[0].token_ids
    single = llm.generate(PROMPTS[0], greedy(bad_words_token_ids=[[plain[3]]]))[0].token_ids
    assert single[:3] == plain[:3] and plain[3] not in single
    pair = [plain[1], plain[2]]
    out = llm.generate(PROMPTS[0], greedy(bad_words_token_ids=[pair]))[0].token_ids
    assert out[:2] == plain[:2] and out[2] != plain[2]  # banned only after its first token
    assert all(out[i : i + 2] != pair for i in range(len(out) - 1))
    assert blocks_all_free(llm)


def test_bad_words_text_is_tokenized_with_and_without_a_leading_space(llm):
    request = llm.processor.process("r", "x", SamplingParams(bad_words=["fox"]))
    encode = llm.tokenizer.encode
    ids = request.sampling_params.bad_words_token_ids
    assert encode("fox", add_special_tokens=False) in ids
    assert encode(" fox", add_special_tokens=False) in ids


def test_a_bad_word_banned_on_decode_counts_the_prefill_token(llm):
    """On D, P's first token is part of the prompt but is output for the bad words."""
    plain = llm.generate(PROMPTS[0], greedy())[0].token_ids
    params = greedy(bad_words_token_ids=[[plain[0], plain[1]]])
    request = llm.processor.process("pd", PROMPTS[0], params)
    first = llm.generate(request.prompt_token_ids, for_prefill(request).sampling_params)[0]
    decode = for_decode(request, first.token_ids[0], {})  # as D gets it: one prior token
    results = {decode.request_id: new_request_output(decode)}
    llm.engine.add_request(decode)
    llm._run(results, use_tqdm=False)
    rest = results[decode.request_id].token_ids
    colocated = llm.generate(PROMPTS[0], params)[0].token_ids
    assert first.token_ids + rest == colocated and colocated[1] != plain[1]


def test_banned_by_bad_words_matches_the_output_tail():
    assert list(banned_by_bad_words([[7], [1, 2, 3]], [9, 1, 2])) == [7, 3]
    assert list(banned_by_bad_words([[1, 2, 3]], [2])) == []  # shorter than the prefix


def test_special_tokens_in_the_text(llm):
    tok = llm.tokenizer
    eos = tok.eos_token_ids[0]
    ids = (
        tok.encode("hello", add_special_tokens=False)
        + [eos]
        + tok.encode("world", add_special_tokens=False)
    )
    eos_text = tok.id_to_token(eos)
    assert eos_text not in tok.decode(ids)
    assert tok.decode(ids, False) == f"hello{eos_text}world"
    assert tok.decode(ids, False, spaces_between_special_tokens=True) == f"hello {eos_text} world"


def test_skip_special_tokens_false_keeps_eos_in_the_output(llm):
    eos = llm.tokenizer.eos_token_ids[0]
    eos_text = llm.tokenizer.id_to_token(eos)
    expected = {True: " " + " ".join([eos_text] * 3), False: eos_text * 3}
    for spaces in (True, False):
        params = greedy(
            logit_bias={eos: 100.0},
            skip_special_tokens=False,
            spaces_between_special_tokens=spaces,
            max_tokens=3,
        )
        assert llm.generate(PROMPTS[0], params)[0].text == expected[spaces]
    assert llm.generate(PROMPTS[0], greedy(logit_bias={eos: 100.0}, max_tokens=3))[0].text == ""


def test_truncate_prompt_tokens_keeps_the_last_ones(llm):
    full = llm.processor.process("r", PROMPTS[1], SamplingParams()).prompt_token_ids
    truncated = llm.processor.process("r", PROMPTS[1], SamplingParams(truncate_prompt_tokens=3))
    assert truncated.prompt_token_ids == full[-3:]
    out = llm.generate(PROMPTS[1], greedy(truncate_prompt_tokens=3))[0].token_ids
    assert out == llm.generate({"prompt_token_ids": full[-3:]}, greedy())[0].token_ids


@pytest.mark.parametrize(
    ("grammar", "matches"),
    [
        (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), r"[0-9]{3}-[a-z]{2}"),
        (StructuredOutputsParams(choice=("yes", "no", "a.b")), r"yes|no|a\.b"),
        (
            StructuredOutputsParams(grammar='start: "id=" NUM\nNUM: /[1-9][0-9]?/'),
            r"id=[1-9][0-9]?",
        ),
    ],
    ids=["regex", "choice", "lark"],
)
def test_regex_choice_and_lark_grammars_constrain_the_output(llm, grammar, matches):
    for seed in range(3):
        params = SamplingParams(
            temperature=1.0, seed=seed, max_tokens=20, structured_outputs=grammar
        )
        out = llm.generate(PROMPTS[0], params)[0]
        assert re.fullmatch(matches, out.text), out.text
        assert out.finish_reason == "stop"
    assert blocks_all_free(llm)


def test_bad_regex_and_grammar_are_refused(llm):
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    bad = StructuredOutputsParams(grammar="start: nowhere")
    with pytest.raises(ValueError, match="invalid grammar"):
        llm.generate("x", SamplingParams(structured_outputs=bad))
    assert not llm.engine.has_work() and blocks_all_free(llm)


def test_params_refuse_bad_values():
    for fields in (
        {"min_p": 1.5},
        {"allowed_token_ids": []},
        {"bad_words": [""]},
        {"truncate_prompt_tokens": 0},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**fields)
