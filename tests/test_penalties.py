"""Penalties, logit bias and top-N logprobs: the batched sampler against a plain per-row,
per-token reference, and end to end against transformers."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import torch

from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.penalties import LogitBias, LogitsAdjustments, TokenCounts, adjust_logits
from pdcluster.engine.sampler import sample
from pdcluster.routing.handoff import for_decode, for_prefill

VOCAB = 50


def reference_adjust(
    logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams
) -> torch.Tensor:
    """One row, one token at a time: bias, then repetition (prompt and output), then
    frequency and presence (output only)."""
    row = [float(x) for x in logits]
    for token, bias in p.logit_bias.items():
        row[token] += bias
    for token in set(prompt) | set(output):
        if row[token] > 0:
            row[token] /= p.repetition_penalty
        else:
            row[token] *= p.repetition_penalty
    for token, count in Counter(output).items():
        row[token] -= p.frequency_penalty * count + p.presence_penalty
    return torch.tensor(row)


PENALTY_KINDS = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def random_params(rng: random.Random, kinds: tuple[str, ...]) -> SamplingParams:
    kind = rng.choice(["none", "bias", "penalties", "both"])
    bias = {}
    if kind in ("bias", "both"):
        bias = {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randint(1, 5))}
    penalties = {}
    if kind in ("penalties", "both"):
        penalties = {
            "presence_penalty": rng.uniform(-2, 2),
            "frequency_penalty": rng.uniform(-2, 2),
            "repetition_penalty": rng.choice([1.0, rng.uniform(0.5, 2.0)]),
        }
        penalties = {k: v for k, v in penalties.items() if k in kinds}
    return SamplingParams(temperature=0, logit_bias=bias, **penalties)


@pytest.mark.parametrize(
    "kinds", [PENALTY_KINDS, ("repetition_penalty",), ("presence_penalty", "frequency_penalty")]
)
@pytest.mark.parametrize("seed", range(4))
def test_batched_adjustments_match_the_per_token_reference(seed, kinds):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    counts = TokenCounts(VOCAB, torch.device("cpu"))
    num_reqs = 9  # more than the tracker's first allocation: it grows
    params = [random_params(rng, kinds) for _ in range(num_reqs)]
    params[0] = dataclasses.replace(params[0], **{kinds[0]: 1.5})  # at least one tracked
    req_ids = [f"r{i}" for i in range(num_reqs)]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))] for _ in req_ids]
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))] for _ in req_ids]
    counts.add("gone", [1, 2], [3])  # a row that is freed and reused below
    counts.remove("gone")
    for rid, p, prompt, out in zip(req_ids, params, prompts, outputs):
        if p.has_penalties:
            counts.add(rid, prompt, out)  # e.g. a D, whose prompt ended with P's token
    for step in range(6):  # counts grow incrementally, as the runner appends tokens
        logits = torch.randn(num_reqs, VOCAB) * 5
        expected = torch.stack(
            [
                reference_adjust(logits[i], prompts[i], outputs[i], params[i])
                for i in range(num_reqs)
            ]
        )
        adjustments = LogitsAdjustments(
            LogitBias.build(params, logits.device), counts.penalties(req_ids, params)
        )
        adjust_logits(logits, adjustments)
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-4)
        new_tokens = [rng.randrange(VOCAB) for _ in req_ids]
        if step == 2:
            new_tokens = [7] * num_reqs  # the same token in every row at once
        counts.append(req_ids, new_tokens)
        for out, token in zip(outputs, new_tokens):
            out.append(token)


def test_nothing_to_adjust_builds_nothing():
    params = [SamplingParams(), SamplingParams(temperature=0)]
    counts = TokenCounts(VOCAB, torch.device("cpu"))
    assert LogitBias.build(params, torch.device("cpu")) is None
    assert counts.penalties(["a", "b"], params) is None
    counts.append(["a", "b"], [1, 2])  # untracked: ignored
    assert len(counts) == 0


def test_sample_adjusts_the_choice_but_reports_raw_logprobs_and_top_n():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    raw = torch.log_softmax(logits, dim=-1)
    params = [
        SamplingParams(temperature=0, logprobs=5, logit_bias={11: 100}),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=0),
    ]
    adjustments = LogitsAdjustments(LogitBias.build(params, logits.device))
    out = sample(logits.clone(), params, [None] * 3, adjustments)
    assert out.token_ids[0] == 11 and out.token_ids[1] == int(raw[1].argmax())
    assert out.logprobs == pytest.approx([float(raw[i, t]) for i, t in enumerate(out.token_ids)])
    top = out.top_logprobs[0]
    order = raw[0].argsort(descending=True)[:5].tolist()
    assert list(top.token_ids) == order
    assert list(top.logprobs) == pytest.approx(raw[0, order].tolist())
    assert out.top_logprobs[1] is None and out.top_logprobs[2] is None


def test_sampling_params_validation():
    for bad in (
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"repetition_penalty": 0},
        {"repetition_penalty": 1e-30},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {5: 101}},
        {"logit_bias": {5: float("nan")}},
        {"logprobs": 21},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


# ---- end to end --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(preset_dir):
    return preset_dir("tiny-llama")


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, block_size=4, num_blocks=256, max_model_len=256, max_num_seqs=8)


def hf_greedy_adjusted(model, prompt: list[int], num_new: int, p: SamplingParams) -> list[int]:
    """Full forwards, no cache, the reference adjustments, argmax."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(num_new):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            token = int(reference_adjust(logits, prompt, out, p).argmax())
            out.append(token)
            ids.append(token)
    return out


def test_greedy_with_penalties_matches_transformers_and_repeats_less(llm, llama_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    prompt = llm.tokenizer.encode("The cat sat on the mat and")
    base = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = llm.generate({"prompt_token_ids": prompt}, base)[0].token_ids
    favoured = plain[1]  # a biased token the model then keeps repeating
    biased = dataclasses.replace(base, logit_bias={favoured: 8.0, plain[0]: -100.0})
    variants = [
        biased,
        dataclasses.replace(biased, frequency_penalty=2.0),
        dataclasses.replace(biased, presence_penalty=2.0),
        dataclasses.replace(biased, repetition_penalty=3.0),
        dataclasses.replace(biased, frequency_penalty=1.0, presence_penalty=-0.5),
        base,  # unpenalized rows in the same batch
    ]
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(variants), variants)
    got = [o.token_ids for o in outs]
    assert got == [hf_greedy_adjusted(hf, prompt, 16, p) for p in variants]
    assert got[-1] == plain and plain[0] not in got[0]
    repeats = [o.count(favoured) for o in got[:4]]
    assert repeats[0] > 3 and all(r < repeats[0] for r in repeats[1:4])
    assert len(llm.engine.runner.token_counts) == 0  # finished requests' rows were freed


def test_top_logprobs_are_the_raw_distribution(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    out = llm.generate("Hello", dataclasses.replace(params, logit_bias={3: 100}))[0].outputs[0]
    assert out.token_ids == [3] * 4 and len(out.top_logprobs) == 4
    for lp, top in zip(out.logprobs, out.top_logprobs):
        assert len(top.token_ids) == 5 and list(top.logprobs) == sorted(top.logprobs, reverse=True)
        assert lp <= top.logprobs[0]  # the forced token is rarely the model's own favourite


def test_a_decode_counts_the_handed_over_token_as_output(llm):
    """D continues from prompt + P's first token: with it counted as output, P's token then
    D's equal the colocated run; counted as prompt, a presence penalty would miss it."""
    prompt = llm.tokenizer.encode("Once upon a time")
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompt}, base)[0].token_ids[0]
    params = dataclasses.replace(base, logit_bias={first: 6.0}, frequency_penalty=1.5)
    colocated = llm.generate({"prompt_token_ids": prompt}, params)[0].token_ids
    request = llm.processor.process("pd", {"prompt_token_ids": prompt}, params)
    on_p = llm.generate({"prompt_token_ids": prompt}, for_prefill(request).sampling_params)
    assert on_p[0].token_ids == colocated[:1]

    def decode(num_prior: int) -> list[int]:
        d = for_decode(request, colocated[0], {})
        d.kv_transfer_params, d.num_prior_output_tokens = None, num_prior
        d.request_id = f"d{num_prior}"
        llm.engine.add_request(d)
        tokens: list[int] = []
        while llm.engine.has_work():
            outputs, _ = llm.engine.step()
            tokens += [t for o in outputs for t in o.new_token_ids]
        return tokens

    assert decode(1) == colocated[1:]
    assert decode(0) != colocated[1:]  # the test can tell the two apart
