"""Our models over the paged KV cache against transformers on tiny random checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdcluster.engine.attention import AttentionMetadata, allocate_kv_cache
from pdcluster.engine.models.loader import ModelInfo, load_model

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
BLOCK_SIZE = 4
VOCAB = 128
DTYPE = torch.float32
CPU = torch.device("cpu")


# ---- shared helpers: tiny checkpoints (reusable from a conftest) ----------------------------


def _tiny_text_kwargs(**overrides) -> dict:
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    return kwargs


def save_hf_model(model, path: Path, **save_kwargs) -> Path:
    model.save_pretrained(str(path), safe_serialization=True, **save_kwargs)
    return path


def make_llama_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    """Llama with GQA (4 query heads, 2 KV heads) and llama3 RoPE scaling."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = transformers.LlamaConfig(**_tiny_text_kwargs(rope_parameters=rope, **overrides))
    torch.manual_seed(seed)
    return save_hf_model(transformers.LlamaForCausalLM(config), path)


def make_qwen2_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    """Qwen2: q/k/v biases and tied embeddings."""
    kwargs = _tiny_text_kwargs(tie_word_embeddings=True, **overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs))
    with torch.no_grad():  # random init leaves biases at zero: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return save_hf_model(model, path)


def make_mistral_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    kwargs = _tiny_text_kwargs(**{"sliding_window": None, "num_key_value_heads": 1, **overrides})
    torch.manual_seed(seed)
    return save_hf_model(
        transformers.MistralForCausalLM(transformers.MistralConfig(**kwargs)), path
    )


IMAGE_TOKEN_ID = VOCAB - 1


def make_llava_checkpoint(path: Path, seed: int = 0, select_strategy: str = "default") -> Path:
    """LLaVA: tiny CLIP (image 32, patch 8 -> 16 patches, 3 layers) + tiny Llama."""
    vision = transformers.CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=16,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=transformers.LlamaConfig(**_tiny_text_kwargs()),
        image_token_id=IMAGE_TOKEN_ID,
        vision_feature_layer=-2,
        vision_feature_select_strategy=select_strategy,
    )
    torch.manual_seed(seed)
    return save_hf_model(transformers.LlavaForConditionalGeneration(config), path)


CHECKPOINT_MAKERS = {
    "llama": make_llama_checkpoint,
    "qwen2": make_qwen2_checkpoint,
    "mistral": make_mistral_checkpoint,
}


def hf_logits(model_dir: Path, input_ids: list[int], **inputs) -> torch.Tensor:
    """[T, vocab] logits of transformers on one unbatched prompt."""
    model = transformers.AutoModelForImageTextToText if "pixel_values" in inputs else None
    model = (model or transformers.AutoModelForCausalLM).from_pretrained(
        str(model_dir), dtype=DTYPE
    )
    with torch.no_grad():
        return model(input_ids=torch.tensor([input_ids]), **inputs).logits[0].float()


def run_step(model, kv_cache, seqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
    """One engine step. seqs: (new token ids, num_computed_tokens, block table) per sequence.
    Returns [T, vocab] logits of every new token."""
    meta = AttentionMetadata.build(
        [computed for _, computed, _ in seqs],
        [len(ids) for ids, _, _ in seqs],
        [table for _, _, table in seqs],
        BLOCK_SIZE,
        CPU,
    )
    input_ids = torch.tensor([t for ids, _, _ in seqs for t in ids])
    with torch.no_grad():
        hidden = model(model.embed_tokens(input_ids), meta.positions, kv_cache, meta)
        return model.compute_logits(hidden)


def load(model_dir: Path, num_blocks: int = 32) -> tuple[torch.nn.Module, ModelInfo, torch.Tensor]:
    model, info = load_model(str(model_dir), CPU, DTYPE)
    return model, info, allocate_kv_cache(num_blocks, BLOCK_SIZE, info, DTYPE, CPU)


def prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB - 1, (length,), generator=gen).tolist()


@pytest.fixture(scope="module", params=sorted(CHECKPOINT_MAKERS))
def text_checkpoint(request, tmp_path_factory) -> Path:
    return CHECKPOINT_MAKERS[request.param](tmp_path_factory.mktemp(request.param))


# ---- text models -------------------------------------------------------------------------


def test_whole_prompt_matches_transformers(text_checkpoint):
    model, _, kv_cache = load(text_checkpoint)
    ids = prompt(13, seed=1)
    ours = run_step(model, kv_cache, [(ids, 0, [0, 1, 2, 3])])
    torch.testing.assert_close(ours, hf_logits(text_checkpoint, ids), atol=ATOL, rtol=0)


def test_two_chunks_out_of_order_blocks(text_checkpoint):
    model, _, kv_cache = load(text_checkpoint)
    ids = prompt(15, seed=2)
    table = [7, 2, 5, 11]  # non-contiguous, out of order
    first = run_step(model, kv_cache, [(ids[:9], 0, table[:3])])
    second = run_step(model, kv_cache, [(ids[9:], 9, table)])
    ours = torch.cat([first, second])
    torch.testing.assert_close(ours, hf_logits(text_checkpoint, ids), atol=ATOL, rtol=0)


def test_mixed_batch_prefill_chunk_and_decodes(text_checkpoint):
    model, _, kv_cache = load(text_checkpoint)
    a, b, c = prompt(11, seed=3), prompt(10, seed=4), prompt(4, seed=5)
    tables = {"a": [9, 3, 14], "b": [1, 12, 6], "c": [4]}
    # Step 1: three prefills (a's first chunk, b and c up to their last token).
    run_step(model, kv_cache, [(a[:5], 0, tables["a"]), (b[:9], 0, tables["b"]), (c[:3], 0, [4])])
    # Step 2: a's second chunk mixed with two decodes.
    seqs = [(a[5:], 5, tables["a"]), (b[9:], 9, tables["b"]), (c[3:], 3, tables["c"])]
    ours = run_step(model, kv_cache, seqs)
    want = torch.cat(
        [
            hf_logits(text_checkpoint, a)[5:],
            hf_logits(text_checkpoint, b)[9:],
            hf_logits(text_checkpoint, c)[3:],
        ]
    )
    torch.testing.assert_close(ours, want, atol=ATOL, rtol=0)


def test_greedy_decode_matches_transformers_generate(tmp_path):
    ckpt = make_llama_checkpoint(tmp_path / "llama", seed=7)
    model, _, kv_cache = load(ckpt)
    ids = prompt(6, seed=6)
    table = [3, 0, 5, 1]
    tokens = list(ids)
    logits = run_step(model, kv_cache, [(ids, 0, table)])
    for _ in range(8):
        tokens.append(int(logits[-1].argmax()))
        logits = run_step(model, kv_cache, [(tokens[-1:], len(tokens) - 1, table)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=DTYPE)
    out = hf.generate(
        torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert tokens == out[0].tolist()


def test_metadata_positions_slots_and_logits_indices():
    meta = AttentionMetadata.build([5, 9], [3, 1], [[8, 2], [1, 6, 4]], BLOCK_SIZE, CPU)
    assert meta.positions.tolist() == [5, 6, 7, 9]
    assert meta.logits_indices.tolist() == [2, 3]
    assert meta.slot_block_ids.tolist() == [2, 2, 2, 4]
    assert meta.slot_offsets.tolist() == [1, 2, 3, 1]
    assert meta.seq_lens.tolist() == [8, 10]
    # A short chunk over a cached context goes as one-token rows, each reading its keys.
    assert meta.prefills == [] and meta.decodes.token_indices is None
    assert meta.decodes.key_mask[:, 0, 0].sum(-1).tolist() == [6, 7, 8, 10]
    # A longer one is a prefill segment: its mask is [new, keys], no query padded.
    meta = AttentionMetadata.build(
        [5, 9], [20, 1], [[8, 2, 3, 5, 7, 0, 10], [1, 6, 4]], BLOCK_SIZE, CPU
    )
    assert [seg.attn_mask.shape for seg in meta.prefills] == [(20, 25)]
    assert meta.decodes.token_indices.tolist() == [20]


def test_model_info_and_legacy_rope_config(tmp_path):
    ckpt = make_llama_checkpoint(tmp_path / "llama")
    model, info = load_model(str(ckpt), CPU, DTYPE)
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (2, 4, 2, 8)
    assert info.eos_token_ids == [2] and info.bos_token_id == 1 and not info.is_multimodal
    # The pre-transformers-5 spelling of the same RoPE gives the same model.
    config = json.loads((ckpt / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}
    (ckpt / "config.json").write_text(json.dumps(config))
    legacy, _ = load_model(str(ckpt), CPU, DTYPE)
    pos = torch.arange(50)
    torch.testing.assert_close(
        legacy.rotary_emb.cos_sin(pos, DTYPE), model.rotary_emb.cos_sin(pos, DTYPE)
    )


def test_sharded_checkpoint_loads(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_tiny_text_kwargs()))
    ckpt = save_hf_model(hf, tmp_path / "sharded", max_shard_size="20KB")
    assert (ckpt / "model.safetensors.index.json").is_file()
    model, _ = load_model(str(ckpt), CPU, DTYPE)
    torch.testing.assert_close(model.lm_head.weight, hf.lm_head.weight)


def test_loader_errors(tmp_path):
    ckpt = make_mistral_checkpoint(tmp_path / "m")
    config_path = ckpt / "config.json"
    config = json.loads(config_path.read_text())

    config_path.write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="not supported"):
        load_model(str(ckpt), CPU, DTYPE)

    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    config_path.write_text(json.dumps({**config, "rope_parameters": rope}))
    with pytest.raises(NotImplementedError, match="yarn"):
        load_model(str(ckpt), CPU, DTYPE)

    config_path.write_text(json.dumps(config))
    weights = load_file(str(ckpt / "model.safetensors"))
    extra = {**weights, "model.extra.weight": torch.zeros(2)}
    save_file(extra, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected.*model.extra.weight"):
        load_model(str(ckpt), CPU, DTYPE)
    del weights["model.norm.weight"]
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        load_model(str(ckpt), CPU, DTYPE)


# ---- LLaVA -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llava_checkpoint(tmp_path_factory) -> Path:
    return make_llava_checkpoint(tmp_path_factory.mktemp("llava"))


def llava_inputs(info: ModelInfo, num_images: int = 2):
    """Prompt with `num_images` expanded placeholder runs, and their pixels."""
    image = [info.image_token_id] * info.num_image_tokens
    ids = [1, 5, 6] + image + [7, 8] + image * (num_images - 1) + [9, 10, 11]
    torch.manual_seed(3)
    pixels = torch.randn(num_images, 3, info.image_size, info.image_size)
    return ids, pixels


def llava_logits(model, info, kv_cache, ids, pixels, chunks: list[int]) -> torch.Tensor:
    """Our logits with image embeddings merged into placeholder rows, prefilled in chunks."""
    with torch.no_grad():
        image_embeds = model.embed_images(pixels).reshape(-1, info.hidden_size)
        ids_t = torch.tensor(ids)
        embeds = model.embed_tokens(ids_t)  # [T, hidden]
        embeds[ids_t == info.image_token_id] = image_embeds
    table, start, out = [6, 2, 9, 0, 13, 4, 11, 1, 8, 3, 15, 5], 0, []
    for size in chunks:
        meta = AttentionMetadata.build([start], [size], [table], BLOCK_SIZE, CPU)
        with torch.no_grad():
            hidden = model(embeds[start : start + size], meta.positions, kv_cache, meta)
            out.append(model.compute_logits(hidden))
        start += size
    return torch.cat(out)


def test_llava_matches_transformers(llava_checkpoint):
    model, info, kv_cache = load(llava_checkpoint)
    assert info.is_multimodal and info.num_image_tokens == 16 and info.image_size == 32
    ids, pixels = llava_inputs(info)
    # The first chunk ends inside the second image, as a chunked prefill would.
    ours = llava_logits(model, info, kv_cache, ids, pixels, chunks=[30, len(ids) - 30])
    want = hf_logits(llava_checkpoint, ids, pixel_values=pixels)
    torch.testing.assert_close(ours, want, atol=ATOL, rtol=0)


def test_llava_full_select_strategy(tmp_path):
    ckpt = make_llava_checkpoint(tmp_path / "full", select_strategy="full")
    model, info, kv_cache = load(ckpt)
    assert info.num_image_tokens == 17
    ids, pixels = llava_inputs(info, num_images=1)
    ours = llava_logits(model, info, kv_cache, ids, pixels, chunks=[len(ids)])
    torch.testing.assert_close(ours, hf_logits(ckpt, ids, pixel_values=pixels), atol=ATOL, rtol=0)


def _rename(name: str, scheme: str) -> str:
    """Checkpoint names as transformers 5 saves them -> an older scheme."""
    if name.startswith("vision_tower."):
        name = "vision_tower.vision_model." + name[len("vision_tower.") :]
    if scheme == "4.52":
        for old, new in (
            ("language_model.model.", "model.language_model."),
            ("language_model.lm_head.", "lm_head."),
            ("vision_tower.", "model.vision_tower."),
            ("multi_modal_projector.", "model.multi_modal_projector."),
        ):
            if name.startswith(old):
                return new + name[len(old) :]
    return name


@pytest.mark.parametrize("scheme", ["legacy", "4.52"])
def test_llava_weight_name_schemes_load_identically(llava_checkpoint, tmp_path, scheme):
    weights = load_file(str(llava_checkpoint / "model.safetensors"))
    assert any(k.startswith("language_model.model.") for k in weights)  # what 5.x writes
    renamed = {_rename(k, scheme): v for k, v in weights.items()}
    target = tmp_path / scheme
    target.mkdir()
    for name in ("config.json", "generation_config.json"):
        (target / name).write_bytes((llava_checkpoint / name).read_bytes())
    save_file(renamed, str(target / "model.safetensors"), metadata={"format": "pt"})
    reference, _ = load_model(str(llava_checkpoint), CPU, DTYPE)
    model, _ = load_model(str(target), CPU, DTYPE)
    want, got = reference.state_dict(), model.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0)
