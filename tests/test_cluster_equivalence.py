"""Disaggregated serving is token-identical to colocated serving and to transformers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdcluster.engine import LLM
from tests.cluster_utils import (
    GREEDY,
    SMALL_ENGINE,
    assert_clean,
    live_object_ids,
    mixed_prompts,
    start,
)

TOPOLOGIES = {
    "1P1D": {"prefill": 1, "decode": 1},
    "1E1P1D": {"encoder": 1, "prefill": 1, "decode": 1},
    "2P1D": {"prefill": 2, "decode": 1},
    "1P2D": {"prefill": 1, "decode": 2},
    "2mixed": {"mixed": 2},
}


@pytest.fixture(scope="module")
def reference(model_dir):
    """Colocated in-process outputs, each checked once against transformers."""
    transformers = pytest.importorskip("transformers")
    from tests.test_engine_vs_transformers import hf_greedy

    llm = LLM(model_dir, **SMALL_ENGINE)
    prompts = mixed_prompts(with_images=True)
    outputs = llm.generate(prompts, GREEDY)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, out in zip(prompts, outputs):
        request = llm.processor.process("ref", prompt, GREEDY)
        inputs = {}
        if request.mm_features:
            inputs["pixel_values"] = torch.stack([f.pixel_values for f in request.mm_features])
        expected = hf_greedy(hf.eval(), request.prompt_token_ids, GREEDY.max_tokens, **inputs)
        assert out.token_ids == expected
    return prompts, [o.token_ids for o in outputs], [o.text for o in outputs]


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_topology_matches_colocated_and_transformers(ray_session, model_dir, reference, topology):
    prompts, expected_ids, expected_text = reference
    with start(model_dir, **TOPOLOGIES[topology]) as cluster:
        baseline = live_object_ids()
        # Twice: the second round runs with warm prefix and encoder caches everywhere.
        for _ in range(2):
            outputs = cluster.generate(prompts, GREEDY)
            assert [o.token_ids for o in outputs] == expected_ids
            assert [o.text for o in outputs] == expected_text
            assert all(o.finish_reason == "length" for o in outputs)
        assert_clean(cluster, baseline)
        stats = cluster.stats()
    roles = {s.role for s in stats}
    if "prefill" in roles:  # the KV really went P -> D through the object store
        assert sum(s.kv_transfer.num_loads for s in stats if s.role == "decode") > 0
    if "encoder" in roles:  # and encoder outputs E -> P, with no encoder run on P
        assert sum(s.ec.loaded for s in stats if s.role == "prefill") > 0


def test_penalties_bias_and_top_logprobs_match_colocated(ray_session, model_dir):
    """P samples the first token under the penalties and bias, D the rest, counting P's token
    as generated: token for token what one colocated engine produces, alternatives included."""
    llm = LLM(model_dir, **SMALL_ENGINE)
    prompts = mixed_prompts(with_images=False)
    firsts = [o.token_ids[0] for o in llm.generate(prompts, GREEDY)]
    # Favour each prompt's own first token: unpenalized it repeats; penalized, P's copy of it
    # must count on D for D to pick what the colocated engine picks.
    biased = [dataclasses.replace(GREEDY, logit_bias={t: 6.0}, logprobs=3) for t in firsts]
    penalized = [
        dataclasses.replace(p, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2)
        for p in biased
    ]
    params = biased + penalized
    expected = llm.generate(prompts * 2, params)
    repeats = [o.token_ids.count(t) for o, t in zip(expected, firsts * 2)]
    assert sum(repeats[len(prompts) :]) < sum(repeats[: len(prompts)])  # penalties bite
    with start(model_dir, prefill=1, decode=1) as cluster:
        baseline = live_object_ids()
        outputs = cluster.generate(prompts * 2, params)
        assert_clean(cluster, baseline)
    for got, want in zip(outputs, expected):
        assert got.token_ids == want.token_ids
        got_top, want_top = got.outputs[0].top_logprobs, want.outputs[0].top_logprobs
        assert [t.token_ids for t in got_top] == [t.token_ids for t in want_top]
        for g, w in zip(got_top, want_top):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def test_vllm_sampling_fields_match_colocated(ray_session, model_dir):
    """allowed_token_ids, bad_words (a pair whose first token P samples), min_p under a
    seed, and special tokens kept in the text: P applies them to the first token and D to
    the rest, token for token and text for text what one colocated engine produces."""
    llm = LLM(model_dir, **SMALL_ENGINE)
    prompts = mixed_prompts(with_images=False)
    plain = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    eos = llm.tokenizer.eos_token_ids[0]
    params = [
        dataclasses.replace(GREEDY, bad_words_token_ids=[[ids[0], ids[1]]], bad_words=["the"])
        for ids in plain
    ] + [
        dataclasses.replace(
            GREEDY,
            temperature=1.0,
            seed=i,
            min_p=0.2,
            allowed_token_ids=sorted({*ids, eos}),
            logit_bias={eos: 3.0},
            skip_special_tokens=False,
        )
        for i, ids in enumerate(plain)
    ]
    expected = llm.generate(prompts * 2, params)
    assert all(o.token_ids != ids for o, ids in zip(expected, plain))  # the bans bite
    with start(model_dir, prefill=1, decode=1) as cluster:
        baseline = live_object_ids()
        outputs = cluster.generate(prompts * 2, params)
        assert_clean(cluster, baseline)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in expected]
