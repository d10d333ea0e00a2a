"""Speculative decoding in the cluster: a D (or a mixed instance) that drafts, with n-gram
lookup or with a draft model, streams exactly the tokens of colocated serving without
drafts, from its first step after the P→D handoff (which carries the target's KV only: D's
draft model catches the prompt up itself), and frees every block it drafted into."""

from __future__ import annotations

import dataclasses

import pytest

from tests.cluster_utils import (
    GREEDY,
    assert_clean,
    instance_stats,
    live_object_ids,
    mixed_prompts,
    start,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
LONG = dataclasses.replace(GREEDY, max_tokens=40)


def speculating(config: dict) -> dict:
    return {"count": 1, "num_cpus": 1, "engine": {"speculative_config": config}}


@pytest.mark.parametrize(
    "method, topology, role",
    [
        ("ngram", {"prefill": 1, "decode": "drafting"}, "decode"),
        ("ngram", {"mixed": "drafting"}, "mixed"),
        ("draft_model", {"prefill": 1, "decode": "drafting"}, "decode"),
    ],
    ids=["ngram-1P1D", "ngram-1mixed", "draft_model-1P1D"],
)
def test_drafting_instances_stream_colocated_tokens(
    ray_session, model_dir, reference, method, topology, role
):
    config = NGRAM
    if method == "draft_model":  # the target itself in int4
        config = {"method": method, "model": model_dir, "quantization": "int4"}
        config["num_speculative_tokens"] = 3
    topology = {r: speculating(config) if v == "drafting" else v for r, v in topology.items()}
    prompts = mixed_prompts(with_images=True)
    with start(model_dir, **topology) as cluster:
        baseline = live_object_ids()
        outputs = cluster.generate(prompts, LONG)
        for prompt, out in zip(prompts, outputs):
            expected = reference(prompt, LONG)
            assert (out.token_ids, out.text) == (expected.token_ids, expected.text)
        drafts = instance_stats(cluster, role).spec_decode
        assert drafts is not None and drafts.num_drafts > 0
        assert drafts.num_accepted_tokens > 0  # the tiny model repeats itself: drafts land
        if role == "decode":
            assert instance_stats(cluster, "prefill").spec_decode is None  # set on D only
        assert_clean(cluster, baseline)
