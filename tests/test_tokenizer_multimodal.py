"""Tokenizer wrapper, chat template, streaming detokenization, and image preprocessing."""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pdcluster.engine import presets
from pdcluster.engine.multimodal import (
    ImageProcessor,
    ImageProcessorConfig,
    decode_data_url,
    expand_image_placeholders,
    load_image,
    mm_hash,
    num_image_tokens,
)
from pdcluster.engine.presets import make_model
from pdcluster.engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    "The model predicts the next token, one step at a time.",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🙂👍🏽🇫🇷!",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "a <image> b <|im_start|>user",
    "What is 2+2? It's $19.99 (12345 items), isn't it?!",
    "",
]

CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": [{"type": "text", "text": "And 3+3? 🙂"}]},
    ],
]
IMAGE_CHAT = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Compare "},
            {"type": "image"},
            {"type": "text", "text": " and "},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ],
    }
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("presets")
    return {
        name: make_model(name, root / name) for name in ("tiny-llama", "tiny-qwen2", "tiny-llava")
    }


@pytest.fixture(scope="module")
def tokenizer(model_dirs) -> Tokenizer:
    return Tokenizer(model_dirs["tiny-llava"])


# --- Tokenizer ---


def test_special_tokens(model_dirs, tokenizer):
    assert tokenizer.bos_token_id == presets.BOS_TOKEN_ID == tokenizer.token_to_id("<s>")
    assert tokenizer.eos_token_ids == [presets.EOS_TOKEN_ID, presets.IM_END_ID]
    assert tokenizer.token_to_id("<image>") == presets.IMAGE_TOKEN_ID
    assert tokenizer.special_ids == frozenset(range(len(presets.SPECIAL_TOKENS)))
    assert tokenizer.vocab_size == 1536
    assert tokenizer.encode("hi")[0] == presets.BOS_TOKEN_ID
    assert tokenizer.encode("hi", add_special_tokens=False)[0] != presets.BOS_TOKEN_ID
    qwen = Tokenizer(model_dirs["tiny-qwen2"])
    assert qwen.bos_token_id is None and qwen.encode("hi")[0] != presets.BOS_TOKEN_ID


@pytest.mark.parametrize("text", TEXTS)
def test_any_text_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-llava"])
def test_same_ids_as_transformers(model_dirs, name):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dirs[name])
    ours = Tokenizer(model_dirs[name])
    for text in TEXTS:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == hf(text, add_special_tokens=add_special).input_ids
            assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-llava"])
def test_chat_template_renders_like_transformers(model_dirs, name):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dirs[name])
    ours = Tokenizer(model_dirs[name])
    chats = CHATS + ([IMAGE_CHAT] if name == "tiny-llava" else [])
    for messages in chats:
        for add_prompt in (True, False):
            expected = hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_prompt
            )
            assert ours.apply_chat_template(messages, add_generation_prompt=add_prompt) == expected
            hf_ids = hf.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=add_prompt, return_dict=False
            )
            assert ours.encode_chat(messages, add_generation_prompt=add_prompt) == list(hf_ids)


def test_chat_template_output(tokenizer):
    rendered = tokenizer.apply_chat_template(IMAGE_CHAT)
    assert rendered == (
        "<s><|im_start|>user\nCompare <image> and <image><|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode_chat(IMAGE_CHAT)
    assert ids.count(presets.IMAGE_TOKEN_ID) == 2 and ids.count(presets.BOS_TOKEN_ID) == 1


def test_text_only_template_rejects_images(model_dirs):
    with pytest.raises(ValueError, match="does not take images"):
        Tokenizer(model_dirs["tiny-llama"]).apply_chat_template(IMAGE_CHAT)


# --- IncrementalDetokenizer ---


def _stream(tokenizer, ids, seed=0, **kwargs):
    """Feed ids in random chunks of 1-3; returns (deltas, stop hit, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    rng = random.Random(seed)
    deltas, hit, i = [], None, 0
    while i < len(ids) and hit is None:
        n = rng.randint(1, 3)
        delta, hit = detok.update(ids[i : i + n])
        deltas.append(delta)
        i += n
    if hit is None:
        deltas.append(detok.flush())
    return deltas, hit, detok


@pytest.mark.parametrize("seed", range(20))
def test_deltas_concatenate_to_full_decode_on_random_ids(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(60)]
    deltas, hit, _ = _stream(tokenizer, ids, seed)
    assert hit is None
    assert "".join(deltas) == tokenizer.decode(ids)


@pytest.mark.parametrize("text", TEXTS[:4])
def test_multibyte_characters_are_never_split(tokenizer, text):
    ids = tokenizer.encode(text * 2, add_special_tokens=False)
    for seed in range(5):
        deltas, _, _ = _stream(tokenizer, ids, seed)
        assert "".join(deltas) == text * 2
        assert not any("\ufffd" in d for d in deltas)


def test_prompt_context_keeps_output_exact(tokenizer):
    prompt = tokenizer.encode("Tell me a story 🙂")
    ids = tokenizer.encode(" about the sea 🌊 and ships", add_special_tokens=False)
    deltas, _, _ = _stream(tokenizer, ids, prompt_token_ids=prompt)
    assert "".join(deltas) == " about the sea 🌊 and ships"


def test_stop_string_spanning_tokens_truncates_output(tokenizer):
    text = "The cat slept. STOPWORD and then more text that must never appear."
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop_ids = tokenizer.encode("STOPWORD", add_special_tokens=False)
    assert len(stop_ids) > 1  # the stop string spans several tokens
    for seed in range(5):
        deltas, hit, detok = _stream(tokenizer, ids, seed, stop=["STOPWORD"])
        assert hit == "STOPWORD"
        assert "".join(deltas) == detok.output_text == "The cat slept. "
        assert detok.update(tokenizer.encode(" more", add_special_tokens=False)) == ("", None)

        deltas, hit, _ = _stream(
            tokenizer, ids, seed, stop=["STOPWORD"], include_stop_str_in_output=True
        )
        assert hit == "STOPWORD" and "".join(deltas) == "The cat slept. STOPWORD"


def test_earliest_stop_string_wins_and_partial_match_is_released(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    deltas, hit, _ = _stream(tokenizer, ids, stop=["delta", "beta"])
    assert hit == "beta" and "".join(deltas) == "alpha "
    # "gamma e" starts like "gamma epsilon" and is held back, then released at the end.
    deltas, hit, _ = _stream(tokenizer, ids, stop=["gamma epsilon"])
    assert hit is None and "".join(deltas) == "alpha beta gamma delta"


def test_held_back_text_waits_for_disambiguation(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["world peace"])
    emitted = ""
    for token_id in tokenizer.encode("hello world", add_special_tokens=False):
        emitted += detok.update([token_id])[0]
    assert emitted == "hello "  # " world" could still become "world peace"
    delta, hit = detok.update(tokenizer.encode(" war", add_special_tokens=False))
    assert hit is None and emitted + delta == "hello world war"


# --- images ---


def _png(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def _random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 4), dtype=np.uint8)
    return Image.fromarray(pixels, "RGBA").convert(mode)


@pytest.mark.parametrize("size", [(50, 37), (37, 50), (32, 32), (17, 9), (200, 120)])
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_preprocessing_matches_clip_image_processor(model_dirs, size, mode):
    clip = pytest.importorskip("transformers.models.clip.image_processing_pil_clip")
    folder = model_dirs["tiny-llava"]
    reference = clip.CLIPImageProcessorPil.from_pretrained(folder)  # the PIL one: no torchvision
    image = _random_image(*size, mode=mode)
    expected = reference(image, return_tensors="pt").pixel_values[0]
    actual = ImageProcessor.from_pretrained(folder).preprocess(image)
    assert actual.shape == (3, 32, 32) and actual.dtype == torch.float32
    assert torch.allclose(actual, expected, atol=1e-4)


def test_preprocessing_pads_when_crop_exceeds_resize():
    clip = pytest.importorskip("transformers.models.clip.image_processing_pil_clip")
    config = {"size": {"height": 20, "width": 25}, "crop_size": {"height": 24, "width": 24}}
    reference = clip.CLIPImageProcessorPil(**config)
    image = _random_image(40, 30)
    expected = reference(image, return_tensors="pt").pixel_values[0]
    actual = ImageProcessor(ImageProcessorConfig.from_dict(config)).preprocess(image)
    assert torch.allclose(actual, expected, atol=1e-4)


def test_load_image_png_jpeg_and_alpha():
    image = _random_image(20, 10)
    assert load_image(_png(image)).tobytes() == image.tobytes()
    assert load_image(_png(image, "JPEG")).size == (20, 10)
    transparent = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    loaded = load_image(_png(transparent))
    assert loaded.mode == "RGB" and loaded.getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize(
    "data", [b"", b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\x00" * 20, b"GIF89a"]
)
def test_load_image_rejects_non_images(data):
    with pytest.raises(ValueError):
        load_image(data)


def test_load_image_rejects_truncated_and_oversized():
    data = _png(_random_image(64, 64))
    with pytest.raises(ValueError):
        load_image(data[: len(data) // 2])
    with pytest.raises(ValueError, match="pixels"):
        load_image(data, max_pixels=1000)
    with pytest.raises(ValueError, match="bytes"):
        load_image(data, max_bytes=100)


def test_decode_data_url():
    data = _png(_random_image(8, 8))
    encoded = base64.b64encode(data).decode()
    assert decode_data_url(f"data:image/png;base64,{encoded}") == data
    assert decode_data_url(f"data:image/jpeg;base64,{encoded[:40]}\n{encoded[40:]}") == data


@pytest.mark.parametrize(
    "url",
    [
        "",
        "http://example.com/cat.png",
        "data:image/png;base64",  # no comma
        "data:image/png;base64,!!!not-base64!!!",
        "data:image/png;base64,abc",  # bad padding
        "data:text/plain;base64,aGVsbG8=",
        "data:image/png,rawdata",  # not base64
        "data:image/png;base64,",
    ],
)
def test_decode_data_url_rejects_malformed(url):
    with pytest.raises(ValueError):
        decode_data_url(url)


def test_mm_hash_follows_pixels_not_container():
    image = _random_image(16, 12)
    from_png, from_bmp = load_image(_png(image)), load_image(_png(image, "BMP"))
    assert mm_hash(from_png) == mm_hash(from_bmp) == mm_hash(image)
    assert mm_hash(image) != mm_hash(_random_image(16, 12, seed=1))
    assert mm_hash(image) != mm_hash(image.transpose(Image.Transpose.ROTATE_90))


def test_expand_image_placeholders():
    img = presets.IMAGE_TOKEN_ID
    pixels = [torch.zeros(3, 4, 4), torch.ones(3, 4, 4)]
    expanded, features = expand_image_placeholders(
        [1, 10, img, 11, img, 12], img, 3, pixels, ["h0", "h1"]
    )
    assert expanded == [1, 10, img, img, img, 11, img, img, img, 12]
    assert [(f.mm_hash, f.offset, f.length) for f in features] == [("h0", 2, 3), ("h1", 6, 3)]
    assert features[1].pixel_values is pixels[1] and features[1].end == 9
    for ids, images in (([1, img, img], pixels[:1]), ([1, 2], pixels[:1]), ([img], [])):
        with pytest.raises(ValueError, match="placeholder"):
            expand_image_placeholders(ids, img, 3, images, ["h"] * len(images))


def test_num_image_tokens_from_config(model_dirs):
    import json

    config = json.loads((model_dirs["tiny-llava"] / "config.json").read_text())
    assert num_image_tokens(config) == 16
    del config["image_seq_length"]
    assert num_image_tokens(config) == 16
    config["vision_feature_select_strategy"] = "full"
    assert num_image_tokens(config) == 17
