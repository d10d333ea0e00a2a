"""The engine's integer CPU kernels: `Int4DotLinear` and `Int8DotLinear` (4- and 8-bit weights
times int8 activations) against the product of their own dequantized weights, and whole
decoder layers in one call (`DecodeKernel`) against the same layer's modules on the same
decode step. No Ray."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.models import tiered_linear
from pdcluster.engine.models.decode_kernel import decode_kernel_for
from pdcluster.engine.models.quantized_linear import (
    GROUP_SIZE,
    DotLinear,
    Int4DotLinear,
    Int4Linear,
    Int8DotLinear,
    Int8Linear,
)
from pdcluster.engine.models.tiered_linear import ROW_BUCKETS
from tests.arch_checkpoints import make_checkpoint
from tests.test_quantization import _linear

pytestmark = pytest.mark.skipif(
    not Int4DotLinear.available(), reason="no engine CPU kernels with AVX512-VNNI or AVX2 here"
)


def _dequantized(layer: DotLinear) -> torch.Tensor:
    """The float32 weight [out, in] that `layer`'s integers and scales hold."""
    if isinstance(layer, Int8DotLinear):
        return (layer.qweight.float() - 128) * layer.scales[:, None]
    out_features, num_groups = layer.out_features, layer.in_features // GROUP_SIZE
    q = torch.empty(out_features, num_groups, GROUP_SIZE)
    at = 0  # byte offset in a row: blocks of up to 8 groups, 4 chunks of 4 bytes per group
    for first in range(0, num_groups, 8):
        lanes = min(8, num_groups - first)
        block = layer.qweight[:, at : at + 16 * lanes].view(out_features, 4, lanes, 4)
        nibbles = torch.stack([block & 0x0F, block >> 4], dim=3)  # [out, j, lane, 2, 4]
        q[:, first : first + lanes] = nibbles.permute(0, 2, 1, 3, 4).reshape(
            out_features, lanes, GROUP_SIZE
        )  # position 8j + 4 * nibble + byte
        at += 16 * lanes
    scale, low = layer.scales.float().unbind(dim=1)  # [out, groups] each
    return (q * scale[..., None] + low[..., None]).view(out_features, -1)


# [out, in]: groups in blocks of 8, some rows ending in a shorter block (in 96, 576, 320)
@pytest.mark.parametrize("shape", [(96, 64), (960, 576), (40, 1536), (24, 320)])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
# (ours, torch's on the same grid, how much farther from float32 ours may be: int8 weights
# err little, so there int8 activations against bf16 ones show)
@pytest.mark.parametrize(
    ("kind", "torch_kind", "factor"),
    [(Int4DotLinear, Int4Linear, 1.2), (Int8DotLinear, Int8Linear, 2.0)],
)
def test_dot_layer_is_its_weights_product_bar_int8_activations(
    shape, rows, kind, torch_kind, factor
):
    torch.manual_seed(0)
    layer = nn.Linear(shape[1], shape[0])
    quantized = kind.from_layer(layer)
    x = torch.randn(rows, shape[1])
    want = F.linear(x, _dequantized(quantized), layer.bias)
    error = (quantized(x) - want).norm(dim=1) / want.norm(dim=1)  # per row
    assert error.max() < 0.01, error  # int8 activations per 32 values: ~0.3% here
    # and near float32 as torch's own layer on the same grid is (where it has one: its int4
    # tiles take out % 16 == 0)
    exact = F.linear(x, layer.weight, layer.bias)
    theirs = torch_kind.from_layer(layer)
    if theirs is not None:
        ours_error = (quantized(x) - exact).norm() / exact.norm()
        assert ours_error < factor * (theirs(x) - exact).norm() / exact.norm()


def test_int4_dot_layer_keeps_a_q4_1_grid_with_its_float16_scales():
    torch.manual_seed(0)
    q = torch.randint(0, 16, (32, 4, GROUP_SIZE)).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(32, 4) * 0.01 + 0.001).half().float()
    m = (torch.randn(32, 4) * 0.02).half().float()
    weight = (q * d[..., None] + m[..., None]).view(32, 128)
    torch.testing.assert_close(_dequantized(Int4DotLinear.from_layer(_linear(weight))), weight)


@pytest.mark.parametrize(("kind", "in_features"), [(Int4DotLinear, 48), (Int8DotLinear, 96)])
def test_dot_layer_leaves_an_input_size_off_its_packing_to_the_others(kind, in_features):
    assert kind.from_layer(_linear(torch.randn(32, in_features))) is None


@pytest.fixture(scope="module")
def int4_everywhere():
    """Every linear quantized at every row count, so that each layer gets its kernel."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiered_linear, "race", lambda formats, layer: [0] * len(ROW_BUCKETS))
        yield


@pytest.fixture(scope="module")
def qwen3_dir(preset_dir, tmp_path_factory):  # q/k norms, and a sliding window on layer 1
    return str(
        make_checkpoint(
            "qwen3", tmp_path_factory.mktemp("qwen3"), preset_dir("tiny-llama"),
            use_sliding_window=True, sliding_window=4, max_window_layers=1,
        )
    )  # fmt: skip


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "qwen3"])  # qwen2: biases
def test_decode_kernel_computes_what_the_layer_modules_do(
    int4_everywhere, preset_dir, qwen3_dir, model
):
    llm = LLM(qwen3_dir if model == "qwen3" else preset_dir(model), quantization="int4")
    runner = llm.engine.runner
    layers = list(runner.model.model.layers)
    assert all(layer.decode_kernel is not None for layer in layers)
    # a decode step of three sequences with their contexts in the cache
    meta = AttentionMetadata.build([5, 9, 17], [1, 1, 1], [[1, 2], [3, 4], [5, 6]], 16, "cpu")
    cos, sin = runner.model.rotary_emb.cos_sin(meta.positions, torch.float32)
    torch.manual_seed(0)
    x = torch.randn(3, runner.model.config.hidden_size)
    with torch.inference_mode():
        runner.kv_cache.normal_()
        for layer in layers:
            cache = runner.kv_cache.clone()
            got = layer.decode_kernel(x, cos, sin, cache, meta)
            kernel, layer.decode_kernel = layer.decode_kernel, None
            want = layer(x, cos, sin, runner.kv_cache, meta)
            layer.decode_kernel = kernel
            assert ((got - want).norm() / want.norm()) < 1e-4
            torch.testing.assert_close(cache, runner.kv_cache)  # the same K/V written
        runner.kv_cache.zero_()
    out = llm.generate(["hello there"], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6


def test_decode_kernel_serves_few_decodes_only(int4_everywhere, preset_dir):
    llm = LLM(preset_dir("tiny-llama"), quantization="int4")
    runner = llm.engine.runner
    kernel = runner.model.model.layers[0].decode_kernel
    kv = runner.kv_cache
    decodes = AttentionMetadata.build([4, 7], [1, 1], [[1], [2]], 16, "cpu")
    mixed = AttentionMetadata.build([4, 0], [1, 5], [[1], [2]], 16, "cpu")
    assert kernel.takes(torch.zeros(2, 64), kv, decodes)
    assert not kernel.takes(torch.zeros(6, 64), kv, mixed)  # a prefill in the step
    kernel.max_rows = 1
    assert not kernel.takes(torch.zeros(2, 64), kv, decodes)


def test_layers_the_kernel_cannot_run_keep_their_modules(int4_everywhere, preset_dir):
    llm = LLM(preset_dir("tiny-llama"), quantization="int4")
    layer = llm.engine.runner.model.model.layers[0]
    assert decode_kernel_for(layer) is not None
    layer.mlp.act = F.gelu
    assert decode_kernel_for(layer) is None
    exact = LLM(preset_dir("tiny-llama"))  # float32: no 4-bit weights
    assert all(lay.decode_kernel is None for lay in exact.engine.runner.model.model.layers)
