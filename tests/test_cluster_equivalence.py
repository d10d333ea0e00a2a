"""Disaggregated serving is token-identical to colocated serving and to transformers."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
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
    roles = {s["role"] for s in stats}
    if "prefill" in roles:  # the KV really went P -> D through the object store
        assert sum(s.get("num_loads", 0) for s in stats if s["role"] == "decode") > 0
    if "encoder" in roles:  # and encoder outputs E -> P, with no encoder run on P
        assert sum(s.get("ec_loaded", 0) for s in stats if s["role"] == "prefill") > 0
