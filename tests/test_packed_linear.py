"""Prepacked linear weights: same results and names as the dense model, memory not doubled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.models.loader import load_model
from pdcluster.engine.models.packed_linear import PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch without oneDNN ops")
CPU = torch.device("cpu")


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_packed_model_keeps_outputs_names_and_ties(preset_dir, preset):
    dense, _ = load_model(preset_dir(preset), CPU, torch.float32)
    packed, _ = load_model(preset_dir(preset), CPU, torch.float32)
    num_linears = sum(type(m) is nn.Linear for m in dense.modules())
    assert pack_linears(packed) == num_linears
    assert not any(type(m) is nn.Linear for m in packed.modules())
    want, got = dense.state_dict(), packed.state_dict()
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    hidden = torch.randn(5, dense.config.hidden_size)
    torch.testing.assert_close(packed.lm_head(hidden), dense.lm_head(hidden))
    layer = packed.model.layers[0].self_attn.q_proj
    assert isinstance(layer, PackedLinear)
    assert layer._dense is None  # the packed copy replaced the dense one
    if dense.config.tie_word_embeddings:  # the embedding still owns the one dense weight
        assert packed.lm_head.weight.data_ptr() == packed.model.embed_tokens.weight.data_ptr()


def test_a_layer_that_differs_keeps_f_linear(monkeypatch):
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    real = torch.ops.mkldnn._linear_pointwise

    def off_by_one(x, w, b, *rest):  # what a broken packed kernel would give
        return real(x, w, b, *rest) + 1.0

    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: off_by_one(
        x, self.packed, self.bias, "none", [], ""))  # fmt: skip
    assert pack_linears(model) == 0
    assert all(type(m) is nn.Linear for m in (model[0], model[2]))
    x = torch.randn(3, 8)
    torch.testing.assert_close(
        model(x), F.linear(F.relu(model[0](x)), model[2].weight, model[2].bias)
    )
