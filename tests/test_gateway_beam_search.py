"""Beam search (`use_beam_search`, `length_penalty`, `n` beams) through the gateway on a 1P1D
cluster, against a plain beam search over transformers' logits on the same checkpoint."""

from __future__ import annotations

import httpx
import pytest
import torch

from pdcluster.cluster.api.beam_search import MAX_BEAM_WIDTH
from tests.cluster_utils import assert_clean, live_object_ids, start

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

MODEL = "tiny-llama"
PROMPT = [5, 17, 42, 9, 77, 31]
WIDTH = 3
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def checkpoint(preset_dir):
    return preset_dir("tiny-llama")


@pytest.fixture(scope="module")
def hf(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def cluster(ray_session, checkpoint):
    with start(checkpoint, prefill=1, decode=1, gateway={"served_model_name": MODEL}) as c:
        yield c


def next_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([token_ids])).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)  # [vocab]


def reference(hf, prompt, width, max_tokens, length_penalty, stop_ids=()):
    """Beam search by full forwards: (tokens, cumulative logprob, finish reason), best first.
    Each beam's candidates are its 2 x width likeliest next tokens; a stop token finishes
    one; scores are cumulative / (prompt + generated) ** length_penalty."""

    def score(beam):
        return beam[1] / (len(prompt) + len(beam[0])) ** length_penalty

    live, finished = [([], 0.0, "length")], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum, _ in live:
            values, indices = next_logprobs(hf, prompt + tokens).topk(2 * width)
            for t, lp in zip(indices.tolist(), values.tolist()):
                if t in stop_ids:
                    finished.append(([*tokens, t], cum + lp, "stop"))
                else:
                    candidates.append(([*tokens, t], cum + lp, "length"))
        live = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(finished + live, key=score, reverse=True)[:width]


def completions(base_url: str, **fields) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "n": WIDTH, **fields}
    body |= {"use_beam_search": True, "logprobs": 0, "ignore_eos": True}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def assert_same_beams(cluster, choices, expected) -> None:
    """Choices (best first) are the expected beams: tokens, text (a stop token is not in it,
    as in ordinary generation), cumulative logprob and finish reason."""
    tokenizer = cluster.tokenizer
    assert [c["index"] for c in choices] == list(range(len(expected)))
    for choice, (ids, cum, reason) in zip(choices, expected):
        tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        assert choice["logprobs"]["tokens"] == tokens
        assert choice["text"] == tokenizer.decode(ids[:-1] if reason == "stop" else ids)
        assert sum(choice["logprobs"]["token_logprobs"]) == pytest.approx(cum, abs=1e-3)
        assert choice["finish_reason"] == reason


def test_beam_search_matches_reference(base_url, cluster, hf):
    baseline = live_object_ids()
    out = completions(base_url)
    assert len(out["choices"]) == WIDTH
    assert_same_beams(cluster, out["choices"], reference(hf, PROMPT, WIDTH, MAX_TOKENS, 1.0))
    assert out["usage"]["completion_tokens"] == WIDTH * MAX_TOKENS
    assert_clean(cluster, baseline)


def test_length_penalty_changes_the_ranking(base_url, cluster, hf):
    """A stop token among the first step's likeliest ends a short beam: ranked first by
    cumulative logprob alone (length_penalty 0), after the long ones with a large penalty."""
    stop = [int(next_logprobs(hf, PROMPT).argmax())]
    short_first = reference(hf, PROMPT, WIDTH, MAX_TOKENS, 0.0, stop)
    long_first = reference(hf, PROMPT, WIDTH, MAX_TOKENS, 8.0, stop)
    assert short_first[0][2] == "stop" and long_first[0][2] == "length"  # the premise
    for penalty, expected in ((0.0, short_first), (8.0, long_first)):
        out = completions(base_url, length_penalty=penalty, stop_token_ids=stop)
        assert_same_beams(cluster, out["choices"], expected)


def test_chat_beam_search(base_url, client, hf):
    messages = [{"role": "user", "content": "Tell me"}]
    prompt = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "messages": messages})
    expected = reference(hf, prompt.json()["tokens"], 2, 3, 1.0)
    out = client.chat.completions.create(
        model=MODEL, messages=messages, n=2, max_tokens=3, logprobs=True,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )  # fmt: skip
    assert len(out.choices) == 2
    cums = [sum(t.logprob for t in c.logprobs.content) for c in out.choices]
    assert cums == pytest.approx([e[1] for e in expected], abs=1e-3)
    assert cums == sorted(cums, reverse=True)


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"stream": True}, "use_beam_search", "use_beam_search cannot be streamed"),
        ({"n": MAX_BEAM_WIDTH + 1}, "use_beam_search", "use_beam_search takes n"),
        ({"length_penalty": 11}, "length_penalty", "length_penalty: Input should be less"),
    ],
)
def test_beam_search_refusals_name_the_field(base_url, fields, param, message):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "use_beam_search": True, **fields}
    response = httpx.post(f"{base_url}/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"].startswith(message) and error["param"] == param
