"""Speculative decoding in the cluster: a D (or a mixed instance) that drafts, with n-gram
lookup or with a draft model, streams exactly the tokens of colocated serving without
drafts, from its first step after the P→D handoff, and frees every block it drafted into. A
P that drafts too computes its draft model's KV for the prompt and the handoff carries it;
else D's draft model catches the prompt up itself."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import ray

from pdcluster.actors.messages import InstanceStats
from tests.cluster_utils import (
    GREEDY,
    assert_clean,
    collect_acting,
    instance_stats,
    live_object_ids,
    mixed_prompts,
    start,
    stats_by_id,
    wait_restarted,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
LONG = dataclasses.replace(GREEDY, max_tokens=40)


def speculating(config: dict, count: int = 1) -> dict:
    return {"count": count, "num_cpus": 1, "engine": {"speculative_config": config}}


def self_draft(model_dir: str) -> dict:
    """The target itself in int4."""
    return {
        "method": "draft_model", "model": model_dir, "quantization": "int4",
        "num_speculative_tokens": 3,
    }  # fmt: skip


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
    config = NGRAM if method == "ngram" else self_draft(model_dir)
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
            if method == "draft_model":  # P sent no draft KV: D caught every prompt up
                lengths = [len(cluster.make_request(p, LONG).prompt_token_ids) for p in prompts]
                assert drafts.num_catch_up_tokens >= sum(lengths)
        assert_clean(cluster, baseline)


def test_a_p_that_drafts_hands_d_its_draft_kv(ray_session, model_dir, reference):
    """P and D draft with the float32 target itself: D drafts from the draft KV P computed
    beside the prompt's (no catch-up but the one token a fully accepted step leaves), and
    every draft is accepted, which a stale or misplaced draft KV would not be."""
    exact_self = {**self_draft(model_dir), "quantization": None}
    drafting = speculating(exact_self)
    prompts = mixed_prompts(with_images=False)  # the drafter reads no image
    with start(model_dir, prefill=drafting, decode=drafting) as cluster:
        baseline = live_object_ids()
        outputs = cluster.generate(prompts, LONG)
        for prompt, out in zip(prompts, outputs):
            assert out.token_ids == reference(prompt, LONG).token_ids
        drafts = instance_stats(cluster, "decode").spec_decode
        assert drafts.num_drafts > 0 and drafts.num_accepted_tokens == drafts.num_draft_tokens
        assert drafts.num_catch_up_tokens <= drafts.num_drafts  # no prompt caught up on D
        assert instance_stats(cluster, "prefill").spec_decode.num_drafts == 0
        assert_clean(cluster, baseline)


def test_a_stream_moved_off_a_dead_d_goes_on_drafting(ray_session, model_dir, reference):
    """D killed mid-stream: the stream moves to the other D, whose draft model catches up on
    the prompt and the tokens so far, and goes on with the undisturbed run's tokens."""
    long = dataclasses.replace(GREEDY, max_tokens=160)
    prompt = "Decode for a long time, then lose D"
    decode = speculating(self_draft(model_dir), count=2)
    with start(model_dir, prefill=1, decode=decode) as cluster:
        baseline = live_object_ids()
        request = cluster.make_request(prompt, long)

        def kill_the_streaming_d() -> InstanceStats:
            stats = stats_by_id(cluster).values()
            killed = next(s for s in stats if s.role == "decode" and s.scheduler.num_running)
            ray.kill(cluster.instances[killed.instance_id][1], no_restart=False)
            return killed

        # after D has streamed tokens
        out, killed = asyncio.run(collect_acting(cluster, request, 3, kill_the_streaming_d))
        assert killed is not None, "the request finished before D could be killed"
        assert (out.finish_reason, out.token_ids) == ("length", reference(prompt, long).token_ids)
        assert cluster.num_moves == 1
        survivor = next(
            s for s in stats_by_id(cluster).values()
            if s.role == "decode" and s.instance_id != killed.instance_id
        )  # fmt: skip
        assert survivor.spec_decode.num_accepted_tokens > 0
        wait_restarted(cluster, killed.instance_id, killed.pid)
        assert_clean(cluster, baseline)


def test_a_draft_model_with_another_vocabulary_is_refused_before_any_instance_starts(
    ray_session, model_dir, preset_dir
):
    other = {"method": "draft_model", "model": preset_dir("tiny-qwen2")}
    decode = speculating({**other, "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="another vocabulary than the target"):
        start(model_dir, prefill=1, decode=decode)
