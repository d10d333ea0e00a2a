"""Linear layers in the formats measured fastest per row count, and the precision settings that
choose which formats a layer may take. No Ray, no real checkpoint."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.models import tiered_linear
from pdcluster.engine.models.packed_linear import (
    PackedLinear,
    native_bf16,
    pack_linears,
    packing_available,
)
from pdcluster.engine.models.quantized_linear import Int8Linear, WeightOnlyLinear
from pdcluster.engine.models.tiered_linear import ROW_BUCKETS, TieredLinear, prepare_linears, tiers
from pdcluster.engine.precision import Precision

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch without oneDNN ops")
CPU = torch.device("cpu")
BF16_AND_F32 = (torch.bfloat16, torch.float32)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.SiLU(), nn.Linear(96, 32, bias=False)).eval()


def test_tiers_join_runs_of_one_winner_and_the_last_serves_every_count():
    winners = [0, 0, 1, 1, 2, 2, 2][: len(ROW_BUCKETS)]
    got = tiers(winners)
    assert [w for w, _ in got] == [0, 1, 2]
    assert got[0][1] == ROW_BUCKETS[1] and got[1][1] == ROW_BUCKETS[3]
    assert got[-1][1] == sys.maxsize
    assert tiers([1] * len(ROW_BUCKETS)) == [(1, sys.maxsize)]


def test_a_tiered_layer_sends_each_row_count_to_its_format():
    small, large = nn.Linear(8, 4), nn.Linear(8, 4)
    layer = TieredLinear([small, large], [2, sys.maxsize])
    for rows, want in ((1, small), (2, small), (3, large), (500, large)):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(layer(x), want(x))
    x = torch.randn(1, 2, 8)  # leading dims count as rows: 2
    torch.testing.assert_close(layer(x), small(x))


@pytest.mark.skipif(not native_bf16(), reason="no native bf16 on this CPU")
def test_bf16_packed_layer_is_close_to_float32_and_keeps_names():
    dense = _model()
    packed = _model()
    assert pack_linears(packed, torch.bfloat16) == 2
    assert all(isinstance(packed[i], PackedLinear) for i in (0, 2))
    assert packed[0].dtype == torch.bfloat16 and packed[0].packed.dtype == torch.bfloat16
    assert list(packed.state_dict()) == list(dense.state_dict())
    for rows in (1, 16, 200):
        x = torch.randn(rows, 64)
        want = dense(x)
        assert ((packed(x) - want).norm() / want.norm()) < 0.01


@pytest.mark.skipif(not Int8Linear.available(), reason="torch without the int8 kernel")
def test_a_raced_model_serves_every_row_count_close_to_float32():
    dense = _model()
    tiered = _model()
    dtypes = BF16_AND_F32 if native_bf16() else (torch.float32,)
    prepare_linears(tiered, "int8", dtypes)
    assert not any(type(m) is nn.Linear for m in tiered.modules())
    for rows in (1, 3, 16, 64, 300):
        x = torch.randn(rows, 64)
        want = dense(x)
        assert ((tiered(x) - want).norm() / want.norm()) < 0.02, rows


def test_formats_that_win_no_bucket_are_not_kept(monkeypatch):
    monkeypatch.setattr(tiered_linear, "race", lambda formats, layer: [1] * len(ROW_BUCKETS))
    model = _model()
    prepare_linears(model, "int8", (torch.float32,))  # int8 loses everywhere: float32 alone
    assert all(isinstance(model[i], PackedLinear) for i in (0, 2))
    assert not any(isinstance(m, WeightOnlyLinear) for m in model.modules())


def test_the_exact_mode_packs_float32_and_fuses_nothing():
    model = _model()
    assert prepare_linears(model, "none", (torch.float32,)) == 0
    assert all(
        isinstance(model[i], PackedLinear) and model[i].dtype == torch.float32 for i in (0, 2)
    )
    x = torch.randn(5, 64)
    torch.testing.assert_close(model(x), _model()(x))


@pytest.mark.parametrize(
    "dtype, quantization, want_dtype, want_linears",
    [
        ("auto", "none", torch.float32, (torch.float32,)),  # the exact mode stays the default
        ("float32", "int4", torch.float32, (torch.float32,)),
        ("bfloat16", "none", torch.float32, (torch.bfloat16,)),  # bf16 weights, f32 activations
        ("float16", "none", torch.float32, (torch.bfloat16,)),  # as vLLM's CPU backend
        ("bfloat16", "int8", torch.float32, (torch.bfloat16,)),
    ],
)
def test_precision_on_cpu(dtype, quantization, want_dtype, want_linears):
    precision = Precision.resolve(dtype, quantization, CPU)
    assert (precision.dtype, precision.linear_dtypes) == (want_dtype, want_linears)
    assert precision.is_exact == (want_linears == (torch.float32,) and quantization == "none")


def test_auto_with_a_quantization_races_bf16_only_where_it_is_native():
    precision = Precision.resolve("auto", "int4", CPU)
    want = BF16_AND_F32 if native_bf16() else (torch.float32,)
    assert precision.linear_dtypes == want and precision.dtype == torch.float32


def test_precision_on_gpu_is_the_whole_model_in_dtype():
    gpu = torch.device("cuda")
    assert Precision.resolve("auto", "none", gpu).dtype == torch.bfloat16
    assert Precision.resolve("float16", "none", gpu).linear_dtypes == (torch.float16,)
    with pytest.raises(ValueError, match="dtype must be"):
        Precision.resolve("int8", "none", CPU)


def test_the_float32_reference_of_a_packed_bf16_layer_is_its_rounded_weight():
    layer = nn.Linear(32, 16)
    packed = PackedLinear.from_linear(layer, keep_dense=False, dtype=torch.bfloat16)
    if packed is None:
        pytest.skip("oneDNN cannot pack bf16 weights here")
    rounded = layer.weight.detach().bfloat16().float()
    torch.testing.assert_close(packed.weight, rounded)
    x = torch.randn(4, 32)
    want = F.linear(x.bfloat16().float(), rounded, layer.bias)
    torch.testing.assert_close(packed(x), want, rtol=1e-2, atol=1e-2)
