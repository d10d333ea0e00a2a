"""The whole engine (scheduler + runner + paged KV) is token-exact with transformers (greedy)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from pdcluster.engine import LLM, SamplingParams, presets

transformers = pytest.importorskip("transformers")

NUM_NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)

# Engine settings that force each scheduling path: plain, chunked prefill, prefix-cache
# hits, and preemption (a KV pool far smaller than the batch needs).
VARIANTS = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 8},
    "preempting": {"block_size": 4, "num_blocks": 40, "max_num_batched_tokens": 64},
}


def hf_greedy(model, input_ids: list[int], num_new: int, **inputs) -> list[int]:
    """Greedy decoding by full forwards, no cache, no EOS handling: the plainest reference."""
    ids = torch.tensor([input_ids])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(num_new):
            logits = model(input_ids=ids, **inputs).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def random_image(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def text_model(request, preset_dir):
    path = preset_dir(request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_text_models_match_transformers(text_model, variant):
    path, hf = text_model
    llm = LLM(path, **VARIANTS[variant])
    vocab = llm.engine.model_info.vocab_size
    prompts = random_prompts(vocab, [5, 17, 40, 63, 2], seed=1)
    prompts.append(llm.tokenizer.encode("The quick brown fox jumps over the lazy dog."))
    outputs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(hf, prompt, NUM_NEW_TOKENS)
        assert out.finish_reason == "length"
    stats = llm.engine.scheduler.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert not llm.engine.scheduler.has_requests()
    if variant == "preempting":
        assert stats["num_preemptions"] > 0


def test_prefix_cache_hits_match_transformers(text_model):
    path, hf = text_model
    llm = LLM(path, block_size=4)
    vocab = llm.engine.model_info.vocab_size
    shared = random_prompts(vocab, [32], seed=2)[0]
    tails = random_prompts(vocab, [3, 9, 1], seed=3)
    prompts = [shared + t for t in tails]
    first = llm.generate(prompts[0], GREEDY)[0]  # fills the prefix cache
    rest = llm.generate(prompts[1:], GREEDY)
    assert all(out.num_cached_tokens >= 32 for out in rest)
    for prompt, out in zip(prompts, [first, *rest]):
        assert out.token_ids == hf_greedy(hf, prompt, NUM_NEW_TOKENS)


@pytest.fixture(scope="module")
def llava(preset_dir):
    path = preset_dir("tiny-llava")
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return path, hf.eval()


@pytest.mark.parametrize("variant", ["plain", "chunked"])
def test_llava_with_images_matches_transformers(llava, variant):
    path, hf = llava
    llm = LLM(path, **VARIANTS[variant])
    images = [random_image(i, size) for i, size in enumerate([(32, 32), (48, 40), (20, 64)])]
    prompts = [
        {"prompt": "Describe <image> briefly.", "multi_modal_data": {"image": images[0]}},
        {"prompt": "<image> and <image>: compare", "multi_modal_data": {"image": images[1:]}},
        {"prompt": "A text-only question in a multimodal batch."},
        # The same picture again: its encoder output is reused from the encoder cache.
        {"prompt": "Again: <image>", "multi_modal_data": {"image": [images[0]]}},
    ]
    outputs = llm.generate(prompts, GREEDY)
    processor = llm.processor
    for prompt, out in zip(prompts, outputs):
        request = processor.process("ref", prompt, GREEDY)
        inputs = {}
        if request.mm_features:
            inputs["pixel_values"] = torch.stack([f.pixel_values for f in request.mm_features])
        assert out.token_ids == hf_greedy(hf, request.prompt_token_ids, NUM_NEW_TOKENS, **inputs)
    stats = llm.engine.scheduler.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


@pytest.mark.slow  # ~30-50 s on 2 cores: a 195M-parameter checkpoint built and run twice
def test_small_llava_matches_transformers(preset_dir):
    """The realistic vision tower (CLIP ViT-B/16, 196 image tokens) on a 30-layer decoder:
    one image prompt, greedy, stopping at EOS as transformers does."""
    path = preset_dir("small-llava")
    llm = LLM(path)
    prompt = {
        "prompt": "Describe <image> briefly.",
        "multi_modal_data": {"image": random_image(0, (48, 40))},
    }
    params = SamplingParams(temperature=0.0, max_tokens=8)
    out = llm.generate(prompt, params)[0]
    request = llm.processor.process("ref", prompt, params)
    assert request.prompt_token_ids.count(presets.IMAGE_TOKEN_ID) == 196
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        reference = hf.eval().generate(
            torch.tensor([request.prompt_token_ids]),
            pixel_values=request.mm_features[0].pixel_values[None],
            max_new_tokens=8,
            do_sample=False,
        )
    assert out.token_ids == reference[0, len(request.prompt_token_ids) :].tolist()
    stats = llm.engine.scheduler.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


def test_stops_on_every_eos_id_like_transformers(preset_dir, tmp_path):
    """generation_config.json may list several EOS ids (Llama-3-Instruct lists three): both
    engines stop at the first token that is any of them, not only at the first id listed."""
    path = shutil.copytree(preset_dir("tiny-llama"), tmp_path / "model")
    prompt = random_prompts(512, [12], seed=4)[0]
    free_run = LLM(str(path)).generate(prompt, GREEDY)[0].token_ids
    stop_id = free_run[5]
    assert presets.EOS_TOKEN_ID not in free_run and stop_id != presets.EOS_TOKEN_ID
    generation = json.loads((path / "generation_config.json").read_text())
    generation["eos_token_id"] = [presets.EOS_TOKEN_ID, stop_id]
    (path / "generation_config.json").write_text(json.dumps(generation))

    out = LLM(str(path)).generate(prompt, SamplingParams(temperature=0.0, max_tokens=24))[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
    assert out.token_ids == free_run[: free_run.index(stop_id) + 1]
    assert out.token_ids == reference[0, len(prompt) :].tolist()
    assert out.finish_reason == "stop"
