"""Qwen3, Qwen3-MoE, Mixtral, Gemma 2 and Gemma 3 through the whole engine (scheduler + paged
KV + runner) against transformers on tiny random checkpoints (float32, greedy), and the MoE
router against transformers' own."""

from __future__ import annotations

import json

import pytest
import torch

from pdcluster.engine import LLM
from pdcluster.engine.models.loader import load_model
from pdcluster.engine.models.moe import SparseMoeBlock, route
from tests.arch_checkpoints import CONFIGS, SLIDING_WINDOW, make_checkpoint, random_model
from tests.test_engine_vs_transformers import GREEDY, NUM_NEW_TOKENS, hf_greedy, random_prompts
from tests.test_models import ATOL, load, run_step

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
PROMPT_LENGTHS = [5, 17, 40, 63, 2]  # several longer than the sliding window
MOE_TYPES = ("mixtral", "qwen3_moe")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def arch(request, preset_dir, tmp_path_factory):
    """(checkpoint folder, transformers model, greedy references memoised by prompt)."""
    path = make_checkpoint(
        request.param, tmp_path_factory.mktemp(request.param), preset_dir("tiny-llama")
    )
    # transformers' grouped_mm experts are slow on CPU; its eager loop computes the same.
    moe = {"experts_implementation": "eager"} if request.param in MOE_TYPES else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **moe)
    hf.eval()
    references: dict[tuple[int, ...], list[int]] = {}

    def reference(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in references:
            references[tuple(prompt)] = hf_greedy(hf, prompt, NUM_NEW_TOKENS)
        return references[tuple(prompt)]

    return str(path), hf, reference


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.engine.scheduler.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert not llm.engine.scheduler.has_requests()


@pytest.mark.parametrize("variant", [{}, {"max_num_batched_tokens": 8}], ids=["batched", "chunked"])
def test_engine_matches_transformers(arch, variant):
    path, _, reference = arch
    llm = LLM(path, block_size=4, **variant)
    prompts = random_prompts(llm.engine.model_info.vocab_size, PROMPT_LENGTHS, seed=1)
    prompts.append(llm.tokenizer.encode("The quick brown fox jumps over the lazy dog."))
    outputs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == reference(prompt)
        assert out.finish_reason == "length"
    assert_all_blocks_free(llm)


def test_prefix_cache_hits_match_transformers(arch):
    path, _, reference = arch
    llm = LLM(path, block_size=4)
    vocab = llm.engine.model_info.vocab_size
    shared = random_prompts(vocab, [32], seed=2)[0]
    prompts = [shared + tail for tail in random_prompts(vocab, [3, 9, 1], seed=3)]
    first = llm.generate(prompts[0], GREEDY)[0]  # fills the prefix cache
    rest = llm.generate(prompts[1:], GREEDY)
    assert all(out.num_cached_tokens >= 32 for out in rest)
    for prompt, out in zip(prompts, [first, *rest], strict=True):
        assert out.token_ids == reference(prompt)
    assert_all_blocks_free(llm)


def test_chunked_logits_match_transformers(arch):
    """Logits, not only argmaxes: a prefill in two chunks over out-of-order blocks, then a
    decode step batched with another sequence's prefill."""
    path, hf, _ = arch
    model, info, kv_cache = load(path)
    a, b = random_prompts(info.vocab_size, [22, 13], seed=4)
    table_a, table_b = [7, 2, 5, 11, 0, 9], [3, 8, 1, 4]
    first = run_step(model, kv_cache, [(a[:10], 0, table_a)])
    second = run_step(model, kv_cache, [(a[10:21], 10, table_a)])
    mixed = run_step(model, kv_cache, [(a[21:], 21, table_a), (b, 0, table_b)])
    with torch.no_grad():
        want_a = hf(input_ids=torch.tensor([a])).logits[0]
        want_b = hf(input_ids=torch.tensor([b])).logits[0]
    torch.testing.assert_close(torch.cat([first, second, mixed[:1]]), want_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[1:], want_b, atol=ATOL, rtol=0)


def test_sliding_windows_follow_the_config(tmp_path, preset_dir):
    """Gemma 2 alternates sliding and full layers; Gemma 3 follows its layer_types."""
    windows = {}
    for model_type in ("gemma2", "gemma3_text"):
        path = make_checkpoint(model_type, tmp_path / model_type, preset_dir("tiny-llama"))
        model, _ = load_model(str(path), CPU, torch.float32)
        windows[model_type] = [layer.self_attn.sliding_window for layer in model.model.layers]
    assert windows["gemma2"] == [SLIDING_WINDOW, None, SLIDING_WINDOW, None]
    assert windows["gemma3_text"] == [SLIDING_WINDOW, None, SLIDING_WINDOW, None]


def test_mistral_sliding_window_matches_transformers(tmp_path):
    """A window smaller than the prompt is honoured, not refused."""
    from tests.test_models import make_mistral_checkpoint

    path = make_mistral_checkpoint(tmp_path / "mistral", sliding_window=SLIDING_WINDOW)
    model, info, kv_cache = load(path)
    ids = random_prompts(info.vocab_size, [30], seed=5)[0]
    table = list(range(8))
    ours = torch.cat(
        [
            run_step(model, kv_cache, [(ids[:17], 0, table)]),
            run_step(model, kv_cache, [(ids[17:], 17, table)]),
        ]
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, want, atol=ATOL, rtol=0)


# ---- MoE routing -----------------------------------------------------------------------------

MOE_CASES = {
    "qwen3_moe-renormalized": ("qwen3_moe", {"norm_topk_prob": True}),
    "qwen3_moe-raw": ("qwen3_moe", {"norm_topk_prob": False}),
    "mixtral": ("mixtral", {}),
}


@pytest.fixture(scope="module", params=sorted(MOE_CASES))
def moe_pair(request, tmp_path_factory):
    """(our model, transformers' model) of the same random MoE checkpoint."""
    model_type, overrides = MOE_CASES[request.param]
    hf = random_model(model_type, 128, seed=3, **overrides)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(str(path))
    ours, _ = load_model(str(path), CPU, torch.float32)
    return ours, hf


def _sparse_layers(model) -> list[int]:
    return [
        i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)
    ]


def test_router_matches_transformers(moe_pair):
    ours, hf = moe_pair
    x = torch.randn(64, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert _sparse_layers(ours)
    for i in _sparse_layers(ours):
        block, hf_block = ours.model.layers[i].mlp, hf.model.layers[i].mlp
        with torch.no_grad():
            hf_logits, hf_weights, hf_ids = hf_block.gate(x)
            weights, ids = route(block.gate(x), block.moe.top_k, block.moe.renormalize)
            got, want = block(x), hf_block(x[None])[0]
        torch.testing.assert_close(block.gate(x), hf_logits, atol=1e-6, rtol=0)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=0)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        if block.moe.renormalize:
            torch.testing.assert_close(weights.sum(-1), torch.ones(len(x)))


def test_sparse_and_dense_layers_match_transformers(moe_pair):
    """Qwen3-MoE's `mlp_only_layers` stay dense; every Mixtral layer is sparse."""
    ours, hf = moe_pair
    want = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert _sparse_layers(ours) == want
    assert len(want) == (len(hf.model.layers) - len(getattr(hf.config, "mlp_only_layers", [])))


def test_tokens_reach_only_the_experts_they_chose(moe_pair):
    ours, _ = moe_pair
    block = ours.model.layers[_sparse_layers(ours)[0]].mlp
    x = torch.randn(5, block.gate.in_features, generator=torch.Generator().manual_seed(1))
    rows_seen = [0] * block.moe.num_experts
    hooks = [
        expert.register_forward_hook(
            lambda m, args, out, e=e: rows_seen.__setitem__(e, rows_seen[e] + len(args[0]))
        )
        for e, expert in enumerate(block.experts)
    ]
    try:
        with torch.no_grad():
            block(x)
            _, ids = route(block.gate(x), block.moe.top_k, block.moe.renormalize)
    finally:
        for hook in hooks:
            hook.remove()
    assert rows_seen == torch.bincount(ids.flatten(), minlength=block.moe.num_experts).tolist()
    assert sum(rows_seen) == len(x) * block.moe.top_k


def test_unsupported_model_type_is_named(tmp_path):
    hf = random_model("qwen3", 128)
    hf.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Qwen3NextForCausalLM.*qwen3_next.*not supported"):
        load_model(str(tmp_path), CPU, torch.float32)
