"""EngineCore behaviour beyond token equality: what a failed step leaves behind, and prefix
blocks shared within the step that computes them."""

from __future__ import annotations

import pytest

from pdcluster.engine import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_num_threads_sets_the_process_torch_threads(preset_dir):
    import torch

    before = torch.get_num_threads()
    want = 2 if before == 1 else 1
    try:
        llm = LLM(preset_dir("tiny-llama"), num_threads=want)
        assert torch.get_num_threads() == want
        assert llm.generate([5, 9, 300], PARAMS)[0].finish_reason == "length"
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="num_threads"):
        LLM(preset_dir("tiny-llama"), num_threads=0)


def test_a_failed_step_fails_every_request_and_forgets_cached_prefixes(preset_dir, monkeypatch):
    path = preset_dir("tiny-llama")
    llm = LLM(path, block_size=4)
    core = llm.engine
    prompt = list(range(5, 37))
    llm.generate({"prompt_token_ids": prompt}, PARAMS)  # caches its blocks
    hit = llm.generate({"prompt_token_ids": [*prompt, 40]}, PARAMS)[0]
    assert hit.num_cached_tokens >= 28

    core.add_request(llm.processor.process("doomed", [*prompt, 41], PARAMS))

    def fail(_scheduler_output):
        raise RuntimeError("injected")

    monkeypatch.setattr(core.runner, "execute_model", fail)
    with pytest.raises(RuntimeError, match="injected"):
        core.step()
    assert core.fail_all() == ["doomed"]
    monkeypatch.undo()

    # The failed step may have written partial KV into cached blocks: nothing is reused.
    again = llm.generate({"prompt_token_ids": [*prompt, 42]}, PARAMS)[0]
    assert again.num_cached_tokens == 0
    fresh = LLM(path, block_size=4).generate({"prompt_token_ids": [*prompt, 42]}, PARAMS)[0]
    assert again.token_ids == fresh.token_ids
    stats = core.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert not core.has_work()


# 2048: one step, all read the 8 blocks the first one writes in it. 24: the first is chunked
# (24 + 11 tokens); the others come with its second chunk and read blocks 6-7 as it writes them.
@pytest.mark.parametrize("budget", [2048, 24])
def test_a_burst_sharing_a_prefix_matches_an_engine_without_prefix_caching(preset_dir, budget):
    path = preset_dir("tiny-llama")
    shared = list(range(5, 37))  # 8 blocks of 4
    prompts = [[*shared, *tail] for tail in ([40, 41, 42], [43] * 9, [44], [45] * 5)]
    args = {"block_size": 4, "max_num_batched_tokens": budget}
    outs = LLM(path, **args).generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    ref = LLM(path, enable_prefix_caching=False, **args).generate(
        [{"prompt_token_ids": p} for p in prompts], PARAMS
    )
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32, 32]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
