"""Speculative decoding in the cluster: a D (or a mixed instance) that drafts with n-gram
lookup streams exactly the tokens of colocated serving without drafts, from its first step
after the P→D handoff, and frees every block it drafted into."""

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
SPECULATING = {"count": 1, "num_cpus": 1, "engine": {"speculative_config": NGRAM}}


@pytest.mark.parametrize(
    "topology, role",
    [({"prefill": 1, "decode": SPECULATING}, "decode"), ({"mixed": SPECULATING}, "mixed")],
    ids=["1P1D", "1mixed"],
)
def test_drafting_instances_stream_colocated_tokens(
    ray_session, model_dir, reference, topology, role
):
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
