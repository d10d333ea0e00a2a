"""prompt_logprobs and echo + logprobs through the gateway on a 1P1D cluster (P computes
the prompt and reports its logprobs): vLLM's and OpenAI's legacy shapes, with the values the
colocated offline engine computes."""

from __future__ import annotations

import json

import httpx
import pytest

from pdcluster.engine import LLM, SamplingParams
from tests.cluster_utils import SMALL_ENGINE, assert_clean, live_object_ids, start

openai = pytest.importorskip("openai")

MODEL = "tiny-llama"
PROMPT = [5, 17, 42, 9, 77, 31, 8, 12, 60]
NUM_TOP = 2


@pytest.fixture(scope="module")
def checkpoint(preset_dir):
    return preset_dir("tiny-llama")


@pytest.fixture(scope="module")
def cluster(ray_session, checkpoint):
    with start(checkpoint, prefill=1, decode=1, gateway={"served_model_name": MODEL}) as c:
        yield c


@pytest.fixture(scope="module")
def colocated(checkpoint):
    """The offline engine's result for PROMPT: greedy, with prompt logprobs."""
    llm = LLM(checkpoint, **SMALL_ENGINE)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=NUM_TOP)
    return llm.generate([PROMPT], params)[0]


def post(base_url: str, path: str, **body) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/{path}", json={"model": MODEL, **body}, timeout=60)


def completion(base_url: str, **fields) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, **fields}
    response = post(base_url, "completions", **body)
    assert response.status_code == 200, response.text
    return response.json()


def test_completion_prompt_logprobs_equal_colocated(base_url, cluster, colocated):
    baseline = live_object_ids()
    choice = completion(base_url, prompt_logprobs=NUM_TOP)["choices"][0]
    assert choice["text"] == colocated.text
    found, expected = choice["prompt_logprobs"], colocated.prompt_logprobs
    assert len(found) == len(PROMPT) and found[0] is None
    token_text = cluster.tokenizer.decode
    for k, entry in enumerate(found[1:]):
        token_id = PROMPT[k + 1]
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(expected.logprobs[k], abs=1e-5)
        assert own["rank"] == expected.ranks[k]
        assert own["decoded_token"] == token_text([token_id], skip_special_tokens=False)
        top = expected.top[k]
        assert [entry[str(t)]["rank"] for t in top.token_ids] == list(range(1, NUM_TOP + 1))
        assert [entry[str(t)]["logprob"] for t in top.token_ids] == pytest.approx(top.logprobs)
        assert set(entry) == {str(t) for t in (token_id, *top.token_ids)}
    plain = completion(base_url)["choices"][0]
    assert plain["prompt_logprobs"] is None and plain["text"] == colocated.text
    assert_clean(cluster, baseline)


def test_chat_prompt_logprobs(base_url, client):
    messages = [{"role": "user", "content": "Hi there"}]
    tokens = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "messages": messages})
    num_prompt = tokens.json()["count"]
    body = {"messages": messages, "max_tokens": 2, "prompt_logprobs": 0}
    out = post(base_url, "chat/completions", **body).json()
    found = out["choices"][0]["prompt_logprobs"]
    assert out["prompt_logprobs"] == found  # vLLM's place, and the choice's
    assert len(found) == num_prompt and found[0] is None
    assert all(len(entry) == 1 and next(iter(entry.values()))["rank"] >= 1 for entry in found[1:])
    sdk = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    assert sdk.model_extra["prompt_logprobs"] == found


def test_echo_with_logprobs_covers_the_prompt(base_url, cluster, colocated):
    out = completion(base_url, echo=True, logprobs=NUM_TOP)["choices"][0]
    prompt_text = cluster.tokenizer.decode(PROMPT, skip_special_tokens=False)
    assert out["text"] == prompt_text + colocated.text
    lp = out["logprobs"]
    num = len(PROMPT)
    token_text = [cluster.tokenizer.decode([t], skip_special_tokens=False) for t in PROMPT]
    assert lp["tokens"][:num] == token_text and len(lp["tokens"]) == num + 5
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:num] == pytest.approx(colocated.prompt_logprobs.logprobs)
    # {text: logprob} of the alternatives and the token itself (texts of two ids may agree)
    tops = lp["top_logprobs"][1:]
    assert all(
        token in top and len(top) <= NUM_TOP + 1 for token, top in zip(lp["tokens"][1:], tops)
    )
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    streamed = _streamed(base_url, echo=True, logprobs=NUM_TOP)
    assert "".join(c["text"] for c in streamed) == out["text"]
    pieces = [c["logprobs"] for c in streamed if c["logprobs"]]
    assert sum((p["tokens"] for p in pieces), []) == lp["tokens"]
    assert sum((p["text_offset"] for p in pieces), []) == lp["text_offset"]
    joined = sum((p["token_logprobs"] for p in pieces), [])
    assert joined[0] is None and joined[1:] == pytest.approx(lp["token_logprobs"][1:])


def _streamed(base_url: str, **fields) -> list[dict]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
    body |= {"ignore_eos": True, **fields}
    choices = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choices += json.loads(line.removeprefix("data: "))["choices"]
    return choices


def test_prompt_logprobs_are_not_streamed(base_url):
    body = {"prompt": "x", "max_tokens": 1, "stream": True, "prompt_logprobs": 1}
    response = post(base_url, "completions", **body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt_logprobs" and "stream" in error["message"]
    too_many = post(base_url, "completions", prompt="x", max_tokens=1, prompt_logprobs=21)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt_logprobs"
