"""prompt_logprobs in the engine: every prompt token's logprob, rank and alternatives, equal to
transformers' log-softmax of the prompt's logits, also under chunked prefill, on a prompt
whose blocks sit in the prefix cache, and after preemption."""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine import LLM, SamplingParams
from tests.test_engine_vs_transformers import random_prompts

transformers = pytest.importorskip("transformers")

NUM_TOP = 3
PROMPT_LOGPROBS = SamplingParams(
    temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=NUM_TOP
)
VARIANTS = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 8},
    "preempting": {"block_size": 4, "num_blocks": 16, "max_num_batched_tokens": 64},
}


@pytest.fixture(scope="module")
def tiny(preset_dir):
    path = preset_dir("tiny-llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row k is the distribution of prompt token k + 1."""
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([prompt])).logits[0]  # [len, vocab]
    return torch.log_softmax(logits.float(), dim=-1)[:-1]


def assert_matches(hf, prompt: list[int], found) -> None:
    ref = hf_prompt_logprobs(hf, prompt)
    assert found.token_ids == prompt[1:]
    next_ids = torch.tensor(prompt[1:])
    chosen = ref.gather(1, next_ids[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(found.logprobs), chosen, atol=1e-4, rtol=1e-4)
    ranks = (ref > chosen[:, None]).sum(dim=1) + 1
    # a tie within float noise may swap two ranks; none of these random prompts has one
    assert found.ranks == ranks.tolist()
    values, indices = ref.topk(NUM_TOP, dim=-1)
    assert [list(t.token_ids) for t in found.top] == indices.tolist()
    top_values = torch.tensor([list(t.logprobs) for t in found.top])
    torch.testing.assert_close(top_values, values, atol=1e-4, rtol=1e-4)


def assert_all_free(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_blocks_total


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prompt_logprobs_match_transformers(tiny, variant):
    path, hf = tiny
    llm = LLM(path, **VARIANTS[variant])
    prompts = random_prompts(llm.engine.model_info.vocab_size, [5, 19, 33], seed=7)
    outputs = llm.generate(prompts, PROMPT_LOGPROBS)
    for prompt, out in zip(prompts, outputs):
        assert_matches(hf, prompt, out.prompt_logprobs)
        assert len(out.token_ids) == 12
    if variant == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_all_free(llm)


def test_prompt_logprobs_skip_the_prefix_cache(tiny):
    """A prompt whose blocks are cached is computed again for its logprobs (and hits nothing),
    and what it generates is what the cached run generated."""
    path, hf = tiny
    llm = LLM(path, block_size=4)
    (prompt,) = random_prompts(llm.engine.model_info.vocab_size, [26], seed=3)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = llm.generate([prompt], plain)[0]
    cached = llm.generate([prompt], plain)[0]
    assert cached.num_cached_tokens >= 24
    out = llm.generate([prompt], PROMPT_LOGPROBS)[0]
    assert out.num_cached_tokens == 0
    assert_matches(hf, prompt, out.prompt_logprobs)
    assert out.token_ids == first.token_ids
    assert llm.generate([prompt], plain)[0].num_cached_tokens >= 24  # its blocks published
    assert_all_free(llm)


def test_one_token_prompt_and_no_alternatives(tiny):
    path, hf = tiny
    llm = LLM(path)
    one, many = llm.generate(
        [[5], [5, 9, 11, 2]], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    )
    assert one.prompt_logprobs.token_ids == []
    assert many.prompt_logprobs.token_ids == [9, 11, 2]
    assert all(t.token_ids == () for t in many.prompt_logprobs.top)
    ref = hf_prompt_logprobs(hf, [5, 9, 11, 2])
    expected = ref.gather(1, torch.tensor([[9], [11], [2]])).squeeze(1)
    torch.testing.assert_close(
        torch.tensor(many.prompt_logprobs.logprobs), expected, atol=1e-4, rtol=1e-4
    )
    assert llm.generate([[5, 9]], SamplingParams(max_tokens=1))[0].prompt_logprobs is None
    assert_all_free(llm)


def test_prompt_logprobs_out_of_range():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
