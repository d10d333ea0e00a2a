"""EngineCore behaviour beyond token equality: what a failed step leaves behind."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


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
