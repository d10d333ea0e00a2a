"""Sizing an instance's KV pool from memory (`kv_cache_memory_fraction`,
`kv_cache_memory_bytes`) instead of `num_blocks`: the arithmetic, the errors, the config
rules and a real engine sized both ways. No Ray."""

from __future__ import annotations

import pytest
import torch

from pdcluster.cluster.config import ClusterConfig
from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.attention import allocate_kv_cache
from pdcluster.engine.config import DEFAULT_NUM_BLOCKS, CacheConfig
from pdcluster.engine.kv_budget import (
    DeviceMemory,
    device_memory,
    kv_block_bytes,
    module_bytes,
    num_blocks_for_memory,
)
from pdcluster.engine.models.loader import read_model_info
from tests.test_cli import serve_config

MiB = 1024**2
GiB = 1024**3
ROLES = {"prefill": {"count": 1}, "decode": {"count": 1}}


# ---- arithmetic --------------------------------------------------------------------------
def test_block_bytes_is_the_size_of_one_allocated_block(preset_dir):
    info = read_model_info(preset_dir("tiny-llama"))
    for dtype in (torch.float32, torch.bfloat16):
        one_block = allocate_kv_cache(1, 16, info, dtype, "cpu")
        assert kv_block_bytes(info, 16, dtype) == one_block.nbytes
    # layers x (K, V) x block_size x kv_heads x head_dim x 4 bytes
    expected = info.num_layers * 2 * 16 * info.num_kv_heads * info.head_dim * 4
    assert kv_block_bytes(info, 16, torch.float32) == expected


def test_fraction_is_of_total_memory_minus_the_weights():
    memory = DeviceMemory(total_bytes=10 * GiB, free_bytes=8 * GiB)
    cache = CacheConfig(kv_cache_memory_fraction=0.5)
    # 5 GiB for weights and KV, 1 GiB of weights: 4 GiB of 1 MiB blocks
    assert num_blocks_for_memory(cache, MiB, 1 * GiB, memory) == 4096
    assert num_blocks_for_memory(cache, 3 * MiB, 1 * GiB, memory) == 4096 // 3


def test_bytes_is_the_kv_cache_alone():
    memory = DeviceMemory(total_bytes=10 * GiB, free_bytes=8 * GiB)
    cache = CacheConfig(kv_cache_memory_bytes=3 * MiB + 1)
    assert num_blocks_for_memory(cache, MiB, 5 * GiB, memory) == 3  # weights do not count


def test_a_budget_the_weights_fill_is_a_clear_error():
    memory = DeviceMemory(total_bytes=10 * GiB, free_bytes=8 * GiB)
    cache = CacheConfig(kv_cache_memory_fraction=0.1)
    with pytest.raises(ValueError, match=r"kv_cache_memory_fraction 0.1 .* less than one block"):
        num_blocks_for_memory(cache, MiB, 2 * GiB, memory)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes leaves .* less than one block"):
        num_blocks_for_memory(CacheConfig(kv_cache_memory_bytes=MiB - 1), MiB, 0, memory)


def test_a_cache_larger_than_free_memory_is_a_clear_error():
    memory = DeviceMemory(total_bytes=10 * GiB, free_bytes=1 * GiB)
    cache = CacheConfig(kv_cache_memory_fraction=0.9)
    with pytest.raises(ValueError, match=r"8.50 GiB does not fit in the 1.00 GiB free"):
        num_blocks_for_memory(cache, MiB, GiB // 2, memory)


def test_cpu_memory_is_capped_by_the_container_limit(tmp_path, monkeypatch):
    import pdcluster.engine.kv_budget as kv_budget

    physical = device_memory(torch.device("cpu"))
    assert 0 < physical.free_bytes <= physical.total_bytes
    monkeypatch.setattr(kv_budget, "CGROUP_ROOT", tmp_path)
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text(f"{64 * MiB}\n")
    unlimited = device_memory(torch.device("cpu"))
    (tmp_path / "memory.max").write_text(f"{512 * MiB}\n")
    limited = device_memory(torch.device("cpu"))
    assert unlimited.total_bytes > 512 * MiB  # "max": the machine's memory
    assert (limited.total_bytes, limited.free_bytes) == (512 * MiB, 448 * MiB)


# ---- config rules ------------------------------------------------------------------------
def test_cache_config_takes_one_sizing_or_the_default():
    assert CacheConfig().num_blocks == DEFAULT_NUM_BLOCKS
    assert CacheConfig(kv_cache_memory_fraction=0.5).num_blocks is None
    with pytest.raises(ValueError, match="set only one of num_blocks, kv_cache_memory_fraction"):
        CacheConfig(num_blocks=8, kv_cache_memory_fraction=0.5)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        CacheConfig(kv_cache_memory_fraction=1.5)


def test_cluster_config_rejects_two_sizings_naming_the_section():
    with pytest.raises(ValueError, match="engine: set only one of"):
        ClusterConfig.load(None, {**ROLES, "engine": {"num_blocks": 8, "kv_cache_memory_bytes": 1}})
    bad_role = {"count": 1, "engine": {"num_blocks": 8, "kv_cache_memory_fraction": 0.5}}
    with pytest.raises(ValueError, match="prefill.engine: set only one of"):
        ClusterConfig.load(None, {**ROLES, "prefill": bad_role})
    with pytest.raises(ValueError, match="engine.kv_cache_memory_fraction: Input should be"):
        ClusterConfig.load(None, {**ROLES, "engine": {"kv_cache_memory_fraction": 0}})


def test_a_role_or_flag_sizing_replaces_the_one_below_it(tmp_path):
    config = ClusterConfig.model_validate(
        {
            "engine": {"num_blocks": 256},
            "prefill": {"count": 1, "engine": {"kv_cache_memory_fraction": 0.25}},
            "decode": {"count": 1},
        }
    )
    prefill, decode = (config.engine_config(r, "m").cache for r in ("prefill", "decode"))
    assert (prefill.num_blocks, prefill.kv_cache_memory_fraction) == (None, 0.25)
    assert (decode.num_blocks, decode.kv_cache_memory_fraction) == (256, None)

    path = tmp_path / "t.yaml"
    path.write_text("engine: {num_blocks: 256}\nmixed: {count: 1}\n")
    flagged = serve_config("--config", str(path), "--kv-cache-memory-fraction", "0.5")
    assert (flagged.engine.num_blocks, flagged.engine.kv_cache_memory_fraction) == (None, 0.5)
    with pytest.raises(ValueError, match="set only one of"):
        serve_config("--mixed", "1", "--num-blocks", "8", "--kv-cache-memory-fraction", "0.5")


# ---- a real engine -----------------------------------------------------------------------
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_engine_sizes_its_pool_from_bytes_and_from_a_fraction(preset_dir):
    path = preset_dir("tiny-llama")
    info = read_model_info(path)
    block_bytes = kv_block_bytes(info, 4, torch.float32)

    by_bytes = LLM(path, block_size=4, kv_cache_memory_bytes=40 * block_bytes + 7)
    assert by_bytes.engine.stats()["num_blocks_total"] == 40
    assert by_bytes.engine.stats()["kv_cache_bytes"] == 40 * block_bytes
    assert by_bytes.engine.config.cache.num_blocks == 40

    weights = module_bytes(by_bytes.engine.runner.model)
    total = device_memory(torch.device("cpu")).total_bytes
    fraction = (weights + 24 * block_bytes + block_bytes // 2) / total
    by_fraction = LLM(path, block_size=4, kv_cache_memory_fraction=fraction)
    assert by_fraction.engine.stats()["num_blocks_total"] == 24

    fixed = LLM(path, block_size=4, num_blocks=40)
    prompt = {"prompt_token_ids": list(range(5, 30))}
    for llm in (by_bytes, by_fraction):
        assert (
            llm.generate(prompt, PARAMS)[0].token_ids == fixed.generate(prompt, PARAMS)[0].token_ids
        )
        stats = llm.engine.stats()
        assert stats["num_blocks_free"] == stats["num_blocks_total"]


def test_engine_refuses_a_fraction_the_weights_fill(preset_dir):
    with pytest.raises(ValueError, match="less than one block"):
        LLM(preset_dir("tiny-llama"), kv_cache_memory_fraction=1e-12)
