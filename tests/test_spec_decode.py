"""Speculative decoding, Ray-free: outputs identical with and without it (greedy, seeded,
penalties, logprobs, n > 1, stop conditions cutting a verified run, structured outputs,
preemption), with n-gram drafts and with a draft model (the target itself, in its own format
and in int4, and a smaller checkpoint with the same tokenizer); the verification rule's
output distribution, rejected slots given back, the config's checks and the proposer's
lookup."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine import core as engine_core
from pdcluster.engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pdcluster.engine.outputs import RunnerOutput
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.sampler import sample
from pdcluster.engine.sampling_params import StructuredOutputsParams
from pdcluster.engine.scheduler import Scheduler
from pdcluster.engine.spec_decode.draft_model import DRAFT_PLACEHOLDER
from pdcluster.engine.spec_decode.ngram_proposer import NgramProposer
from pdcluster.engine.spec_decode.verify import num_accepted
from pdcluster.routing.fanout import fan_out

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
DRAFTING = {"method": "draft_model", "model": "preset:tiny-llama", "num_speculative_tokens": 4}
ENGINE = {"block_size": 16, "num_blocks": 128}
GREEDY = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
# Mixed lengths; repetitive ones, and random-weight models fall into loops that drafts hit.
PROMPTS = [
    list(range(5, 40)) * 3,
    [7, 8, 9, 7, 8, 9, 7, 8],
    [100, 200, 300, 400, 100, 200] * 5,
    [11],
    list(range(500, 530)),
]


@pytest.fixture(scope="module")
def plain(preset_dir):
    return LLM(preset_dir("tiny-llama"), **ENGINE)


@pytest.fixture(scope="module")
def spec(preset_dir):
    return LLM(preset_dir("tiny-llama"), **ENGINE, speculative_config=SPEC)


@pytest.fixture(autouse=True)
def blocks_clean(request):
    """After each engine test: every block of each engine it used is free again."""
    yield
    for name in ("plain", "spec"):
        if name in request.fixturenames:
            stats = request.getfixturevalue(name).engine.stats()
            assert stats["num_blocks_free"] == stats["num_blocks_total"]


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def accepted(llm: LLM) -> int:
    return llm.engine.stats()["spec_decode"].num_accepted_tokens


def both(plain: LLM, spec: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple:
    """Outputs without and with speculation, and the drafts accepted meanwhile."""
    before = accepted(spec)
    return (
        generate(plain, prompts, params),
        generate(spec, prompts, params),
        accepted(spec) - before,
    )


# ---- identical outputs -------------------------------------------------------------------
def test_greedy_outputs_are_token_identical_with_drafts_accepted(plain, spec):
    want, got, num_accepted_tokens = both(plain, spec, PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert num_accepted_tokens > 50  # many steps emitted several tokens
    stats = spec.engine.stats()["spec_decode"]
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    assert stats.num_accepted_tokens_per_pos == sorted(stats.num_accepted_tokens_per_pos)[::-1]


def test_logprobs_are_those_without_drafts(plain, spec):
    params = dataclasses.replace(GREEDY, logprobs=3, max_tokens=48)
    want, got, num_accepted_tokens = both(plain, spec, PROMPTS[:3], params)
    assert num_accepted_tokens > 0
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.outputs[0].logprobs, w.outputs[0].logprobs, atol=1e-4)
        assert [t.token_ids for t in g.outputs[0].top_logprobs] == [
            t.token_ids for t in w.outputs[0].top_logprobs
        ]


def test_penalties_count_the_drafts_before_each_position(plain, spec):
    params = dataclasses.replace(
        GREEDY, repetition_penalty=1.1, frequency_penalty=0.05, presence_penalty=0.05
    )
    want, got, num_accepted_tokens = both(plain, spec, PROMPTS, params)
    assert num_accepted_tokens > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_seeded_sampling_is_identical_and_n_children_too(plain, spec):
    params = SamplingParams(
        temperature=0.7, top_k=40, top_p=0.95, seed=7, max_tokens=64, ignore_eos=True
    )
    want, got, num_accepted_tokens = both(plain, spec, PROMPTS, params)
    assert num_accepted_tokens > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]

    def children(llm: LLM) -> dict[str, list[int]]:
        parent = llm.processor.process("fan", {"prompt_token_ids": PROMPTS[2]}, params)
        tokens: dict[str, list[int]] = {}
        for child in fan_out(parent, 3):
            llm.engine.add_request(child)
            tokens[child.request_id] = []
        while llm.engine.has_work():
            for out in llm.engine.step()[0]:
                tokens[out.request_id] += out.new_token_ids
        return tokens

    spread = children(spec)
    assert spread == children(plain)
    assert len({tuple(t) for t in spread.values()}) == 3


def test_max_tokens_and_stop_tokens_cut_a_verified_run(plain, spec):
    full = generate(plain, PROMPTS[:1], GREEDY)[0].token_ids
    for max_tokens in (37, 41, 50):
        params = dataclasses.replace(GREEDY, max_tokens=max_tokens)
        want, got, _ = both(plain, spec, PROMPTS[:1], params)
        assert got[0].token_ids == want[0].token_ids == full[:max_tokens]
    for k in (30, 45, 70):
        params = dataclasses.replace(GREEDY, stop_token_ids=[full[k]])
        want, got, _ = both(plain, spec, PROMPTS[:1], params)
        assert got[0].token_ids == want[0].token_ids
        assert got[0].outputs[0].stop_reason == full[k]


def test_structured_outputs_follow_their_grammar_with_drafts(plain, spec):
    regex = "(ab|cd|ef)( (ab|cd|ef)){40}"
    structured = StructuredOutputsParams(regex=regex)
    params = dataclasses.replace(GREEDY, ignore_eos=False, structured_outputs=structured)
    want, got, num_accepted_tokens = both(plain, spec, PROMPTS[:3], params)
    assert num_accepted_tokens > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for out in got:
        assert re.fullmatch(regex, out.text), out.text


def step_sizes(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    """Tokens each step emitted for one request."""
    llm.engine.add_request(llm.processor.process("sizes", {"prompt_token_ids": prompt}, params))
    sizes = []
    while llm.engine.has_work():
        sizes += [len(out.new_token_ids) for out in llm.engine.step()[0]]
    return sizes


def test_stop_strings_cut_a_verified_run(plain, spec, monkeypatch):
    full = generate(plain, PROMPTS[:1], GREEDY)[0]
    decode = spec.tokenizer.decode
    # Tokens inside a verified run (not the last of their step) whose text ends a new prefix
    # of the output's text: that prefix, as a stop string, is first complete there.
    ends = np.cumsum(step_sizes(spec, PROMPTS[0], GREEDY))
    inside = [t for t in range(len(full.token_ids)) if t + 1 not in ends]
    stops = [
        (t, decode(full.token_ids[: t + 1]))
        for t in inside
        if full.text.startswith(decode(full.token_ids[: t + 1]))
        and len(decode(full.token_ids[: t + 1])) > len(decode(full.token_ids[:t]))
    ]
    assert stops
    cuts = []
    truncate = engine_core._truncate
    monkeypatch.setattr(engine_core, "_truncate", lambda out, n: (cuts.append(n), truncate(out, n)))
    t, stop = stops[0]
    params = dataclasses.replace(GREEDY, stop=[stop], include_stop_str_in_output=True, logprobs=0)
    want, got, _ = both(plain, spec, PROMPTS[:1], params)
    w, g = want[0].outputs[0], got[0].outputs[0]
    assert (g.text, g.token_ids) == (w.text, w.token_ids) == (stop, full.token_ids[: t + 1])
    assert len(g.logprobs) == t + 1
    assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason) == ("stop", stop)
    assert cuts  # the spec run cut a step's tokens after the stop string


def test_preempted_speculating_requests_resume_identically(preset_dir):
    tight = {"block_size": 16, "num_blocks": 15}  # each request fits alone, not all together
    params = dataclasses.replace(GREEDY, max_tokens=64)
    want = generate(LLM(preset_dir("tiny-llama"), **tight), PROMPTS, params)
    llm = LLM(preset_dir("tiny-llama"), **tight, speculative_config=SPEC)
    got = generate(llm, PROMPTS, params)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode"].num_accepted_tokens > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


# ---- a draft model -----------------------------------------------------------------------
def draft_config(model: str, quantization: str | None = None) -> dict:
    return {**DRAFTING, "model": model, "quantization": quantization}


def test_the_target_drafting_for_itself_has_every_draft_accepted(preset_dir, plain):
    """Its draft KV is the target's, so each draft is the target's own greedy token: any
    position whose draft KV were stale or misplaced (the prompt's catch-up, a fully accepted
    step's two tokens, trimmed blocks) would show as a rejected draft."""
    model = preset_dir("tiny-llama")
    llm = LLM(model, **ENGINE, speculative_config=draft_config(model))
    want, got, num_accepted_tokens = both(plain, llm, PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = llm.engine.stats()
    drafts = stats["spec_decode"]
    assert drafts.num_drafts > 0 and drafts.num_accepted_tokens == drafts.num_draft_tokens
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


def test_the_target_in_int4_drafting_for_itself_changes_no_output(preset_dir, plain):
    """Greedy, seeded and structured outputs of the float32 target are its own."""
    model = preset_dir("tiny-llama")
    llm = LLM(model, **ENGINE, speculative_config=draft_config(model, "int4"))
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=48, ignore_eos=True)
    regex = "(ab|cd|ef)( (ab|cd|ef)){20}"
    structured = SamplingParams(
        temperature=0.0, max_tokens=96, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    for params in (GREEDY, seeded, structured):
        want, got, _ = both(plain, llm, PROMPTS, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(re.fullmatch(regex, o.text) for o in got)
    stats = llm.engine.stats()
    assert stats["spec_decode"].num_accepted_tokens > 0
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


def test_another_checkpoint_with_the_same_tokenizer_drafts(preset_dir, plain):
    """Other layers, heads and width: its own KV cache over the target's blocks. (Its random
    weights share nothing with the target's: few drafts land, and no output changes.)"""
    config = draft_config(preset_dir("small-llama"))
    llm = LLM(preset_dir("tiny-llama"), **ENGINE, speculative_config=config)
    params = dataclasses.replace(GREEDY, max_tokens=24)
    want, got, _ = both(plain, llm, PROMPTS[:2], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = llm.engine.stats()
    assert stats["spec_decode"].num_draft_tokens > 0
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


def test_a_preempted_request_catches_its_draft_up_again(preset_dir):
    tight = {"block_size": 16, "num_blocks": 15}  # each request fits alone, not all together
    params = dataclasses.replace(GREEDY, max_tokens=64)
    model = preset_dir("tiny-llama")
    want = generate(LLM(model, **tight), PROMPTS, params)
    llm = LLM(model, **tight, speculative_config=draft_config(model))
    got = generate(llm, PROMPTS, params)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    drafts = stats["spec_decode"]  # a stale draft KV after the resume would be rejected
    assert drafts.num_accepted_tokens == drafts.num_draft_tokens > 0
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


def test_a_draft_model_with_another_vocabulary_is_refused_at_load(preset_dir):
    config = draft_config(preset_dir("tiny-qwen2"))
    with pytest.raises(ValueError, match="another vocabulary than the target"):
        LLM(preset_dir("tiny-llama"), **ENGINE, speculative_config=config)
    with pytest.raises(ValueError, match="tensor_parallel_size 1 only"):
        LLM(preset_dir("tiny-llama"), speculative_config=DRAFTING, tensor_parallel_size=2)


def test_the_scheduler_gives_a_draft_model_k_slots_within_max_tokens():
    scheduler = make_scheduler(method="draft_model", model="m")
    add(scheduler, "a", [1, 2, 3], max_tokens=4)
    step(scheduler, {"a": [7]})  # the prefill samples token 1 of 4
    slots = step(scheduler, {"a": [8]}).scheduled_spec_decode_tokens["a"]
    assert slots == [DRAFT_PLACEHOLDER] * 2  # tokens 2 and 3 drafted, the 4th sampled


# ---- the scheduler's part ----------------------------------------------------------------
def make_scheduler(**spec: object) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=256),
        CacheConfig(block_size=4, num_blocks=32),
        speculative_config=SpeculativeConfig.from_dict({**SPEC, **spec}),
    )


def add(scheduler: Scheduler, rid: str, prompt: list[int], **params: object) -> Request:
    params = {"max_tokens": 20, "ignore_eos": True, **params}
    request = Request(rid, prompt, SamplingParams(**params))
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler, sampled: dict[str, list[int]]):
    """One step whose runner samples `sampled[req_id]`; returns its SchedulerOutput."""
    so = scheduler.schedule()
    rids = list(so.num_scheduled_tokens)
    runner = RunnerOutput(rids, {r: i for i, r in enumerate(rids)}, [sampled[r] for r in rids])
    scheduler.update_from_output(so, runner)
    return so


def test_rejected_drafts_give_back_their_slots():
    scheduler = make_scheduler()
    kv = scheduler.kv_cache_manager
    request = add(scheduler, "r", [1, 2, 3, 4, 5, 6, 7, 1, 2])  # 9 tokens: 3 blocks
    step(scheduler, {"r": [3]})  # prefill; the output ends in 1 2 3: drafts 4 5 6 7
    so = step(scheduler, {"r": [4, 5, 9]})  # 2 of 4 accepted, then the target's 9
    assert so.scheduled_spec_decode_tokens == {"r": [4, 5, 6, 7]}
    assert so.num_scheduled_tokens == {"r": 5}  # positions 9..13: 4 blocks
    assert request.output_token_ids == [3, 4, 5, 9]
    assert request.num_computed_tokens == 12  # 3, 4, 5 computed; 9 not yet
    assert len(kv.req_to_blocks["r"]) == 3  # the 4th block held only rejected drafts
    assert kv.get_num_free_blocks() == 32 - 3
    stats = scheduler.speculation.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0, 0]

    so = step(scheduler, {"r": [1]})  # 9 has no earlier occurrence: no drafts
    assert not so.scheduled_spec_decode_tokens
    assert so.scheduled_cached_reqs.num_trimmed_blocks == [1]  # the runner drops it too
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert kv.get_num_free_blocks() == 32


def test_drafts_never_exceed_max_tokens_or_the_budget():
    scheduler = make_scheduler()
    add(scheduler, "r", [1, 2, 3, 4, 5, 6, 7, 1, 2], max_tokens=3)
    step(scheduler, {"r": [3]})
    so = step(scheduler, {"r": [4, 5]})
    assert so.scheduled_spec_decode_tokens == {"r": [4]}  # 2 tokens left: 1 draft + 1
    assert scheduler.requests == {}  # finished at max_tokens
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 32


def test_no_drafts_above_disable_by_batch_size():
    scheduler = make_scheduler(disable_by_batch_size=1)
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    add(scheduler, "a", prompt)
    add(scheduler, "b", prompt)
    step(scheduler, {"a": [3], "b": [3]})
    assert not step(scheduler, {"a": [4], "b": [4]}).scheduled_spec_decode_tokens
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert step(scheduler, {"a": [5, 6]}).scheduled_spec_decode_tokens  # alone now


# ---- the verification rule's distribution ------------------------------------------------
NUM_TRIALS = 6000
CHI2_999 = 18.47  # chi-square quantile 0.999 at 4 degrees of freedom (5 tokens after top-k)
LOGITS = torch.tensor([[1.0, 0.5, 0.0, -0.5, 0.8, -3.0], [0.0, 1.2, -0.4, 0.3, 0.6, 0.9]])
PARAMS = SamplingParams(temperature=0.8, top_k=5)
DRAFT = [1]


def target_probs(row: torch.Tensor) -> np.ndarray:
    """The target's distribution under PARAMS, computed here from its definition."""
    scaled = row / PARAMS.temperature
    scaled[scaled < scaled.topk(PARAMS.top_k).values[-1]] = float("-inf")
    return torch.softmax(scaled, dim=-1).numpy()


def emitted_counts(rule) -> tuple[np.ndarray, np.ndarray]:
    """Verify DRAFT NUM_TRIALS times: a step's two rows (LOGITS: the distribution at the
    draft's position, then after it) sampled by the sampler, `rule(draft, targets)` the
    tokens emitted. Counts of the first emitted token, and of the second where there is one."""
    torch.manual_seed(0)
    rows = LOGITS.repeat(NUM_TRIALS, 1)  # [2 * NUM_TRIALS, vocab]
    tokens = sample(rows, [PARAMS] * len(rows), [None] * len(rows)).token_ids
    first, second = np.zeros(LOGITS.shape[1]), np.zeros(LOGITS.shape[1])
    for t in range(NUM_TRIALS):
        emitted = rule(DRAFT, tokens[2 * t : 2 * t + 2])
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    return first, second


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0  # nothing outside the target's support
    expected = probs[keep] * counts.sum()
    return float(((counts[keep] - expected) ** 2 / expected).sum())


def verify(draft: list[int], targets: list[int]) -> list[int]:
    return targets[: num_accepted(draft, targets) + 1]


def test_verification_samples_the_target_distribution():
    first, second = emitted_counts(verify)
    p0, p1 = target_probs(LOGITS[0]), target_probs(LOGITS[1])
    assert chi_square(first, p0) < CHI2_999
    assert chi_square(second, p1) < CHI2_999  # after an accepted draft
    assert abs(second.sum() / NUM_TRIALS - p0[DRAFT[0]]) < 0.03  # accepted as often as p(d)


def test_the_chi_square_test_fails_a_wrong_rule():
    always_accept = lambda draft, targets: [*draft, targets[-1]]  # noqa: E731
    first, _ = emitted_counts(always_accept)
    assert chi_square(first, target_probs(LOGITS[0])) > CHI2_999


# ---- config and proposer -----------------------------------------------------------------
@pytest.mark.parametrize(
    "settings, message",
    [
        ({**SPEC, "num_speculative_token": 4}, "unknown key"),
        ({"method": "ngram"}, "'num_speculative_tokens' is required"),
        ({**SPEC, "method": "eagle"}, "method must be one of"),
        ({**SPEC, "method": "draft_model"}, "'model' .* is required with method 'draft_model'"),
        ({**SPEC, "model": "m"}, "and only there"),
        ({**DRAFTING, "quantization": "int3"}, "quantization must be one of"),
        ({**SPEC, "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({**SPEC, "num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
        ({**SPEC, "prompt_lookup_min": 4}, r"prompt_lookup_min \(4\) must not exceed"),
        ({**SPEC, "disable_by_batch_size": 0}, "disable_by_batch_size must be"),
        ("ngram", "must be a dict"),
    ],
)
def test_config_errors_name_the_problem(settings, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(settings)


def test_config_defaults_and_llm_argument(preset_dir):
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (1, 5)
    assert config.disable_by_batch_size is None
    with pytest.raises(ValueError, match="unknown key"):
        LLM(preset_dir("tiny-llama"), speculative_config={**SPEC, "typo": 1})


@pytest.mark.parametrize(
    "tokens, max_num_tokens, want",
    [
        ([1, 2, 3, 4, 1, 2], 4, [3, 4, 1, 2]),  # K = 4
        ([1, 2, 8, 7, 1, 2, 9, 7, 1, 2], 3, [9, 7, 1]),  # the longest n-gram, not the earliest
        ([5, 1, 2, 5, 1, 2, 5, 1, 2], 2, [5, 1]),  # the earliest of the longest
        ([1, 2, 1], 9, [2, 1]),  # fewer at the end
        ([1, 2, 3], 4, []),  # no earlier occurrence
        ([4], 4, []),
    ],
)
def test_ngram_proposer_finds_the_longest_earlier_suffix(tokens, max_num_tokens, want):
    proposer = NgramProposer(SpeculativeConfig.from_dict(SPEC))
    assert proposer.propose(tokens, max_num_tokens) == want


def test_ngram_proposer_honours_prompt_lookup_min():
    config = SpeculativeConfig.from_dict({**SPEC, "prompt_lookup_min": 2})
    assert NgramProposer(config).propose([1, 2, 3, 1], 4) == []  # only a 1-gram matches
    assert NgramProposer(config).propose([1, 2, 3, 1, 2], 4) == [3, 1, 2]
