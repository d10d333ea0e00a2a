"""n > 1 and best_of through the OpenAI-compatible gateway, driven by the unmodified openai
client: n choices per prompt, streamed by index, usage counting each prompt once."""

from __future__ import annotations

from collections import defaultdict

import httpx
import pytest

from pdcluster.cluster.api.protocol import MAX_N
from tests.cluster_utils import assert_clean, live_object_ids, random_image, start
from tests.gateway_utils import data_url

openai = pytest.importorskip("openai")

MODEL = "tiny-llava"
PROMPT = "Hello there"
SAMPLED = {"temperature": 1.0, "max_tokens": 8, "seed": 7, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def cluster(ray_session, model_dir):
    gateway = {"served_model_name": MODEL}
    with start(model_dir, encoder=1, prefill=1, decode=1, gateway=gateway) as c:
        yield c


def streamed(chunks, field) -> tuple[dict[int, str], dict[int, str], object]:
    """Text and finish reason by choice index, and the last chunk's usage."""
    texts: dict[int, str] = defaultdict(str)
    reasons: dict[int, str] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += field(choice) or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return dict(texts), reasons, usage


def test_completions_n(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, n=3, **SAMPLED)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert len({c.text for c in out.choices}) == 3  # seeded children draw differently
    again = client.completions.create(model=MODEL, prompt=PROMPT, n=3, **SAMPLED)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    alone = client.completions.create(model=MODEL, prompt=PROMPT, **SAMPLED)
    assert out.choices[0].text == alone.choices[0].text
    assert out.usage.prompt_tokens == alone.usage.prompt_tokens  # the prompt counts once
    assert out.usage.completion_tokens == 3 * 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 3 * 8


def test_a_batch_numbers_choices_prompt_by_prompt(client):
    prompts = ["one", "two three"]
    out = client.completions.create(
        model=MODEL,
        prompt=prompts,
        n=2,
        max_tokens=4,
        temperature=0,
        extra_body=SAMPLED["extra_body"],
    )
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    singles = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
        for p in prompts
    ]
    # Greedy: both choices of a prompt are that prompt's one completion.
    assert texts == [singles[0].choices[0].text] * 2 + [singles[1].choices[0].text] * 2
    assert out.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)


def test_streamed_completions_n(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, n=3, **SAMPLED)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, n=3, stream=True, stream_options={"include_usage": True},
        **SAMPLED,
    )  # fmt: skip
    texts, reasons, usage = streamed(stream, lambda c: c.text)
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 3 * 8 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_n_whole_and_streamed(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, **SAMPLED)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 3 * 8
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=3, stream=True, stream_options={"include_usage": True},
        **SAMPLED,
    )  # fmt: skip
    chunks = list(stream)
    roles = {c.index for chunk in chunks for c in chunk.choices if c.delta.role == "assistant"}
    assert roles == {0, 1, 2}
    texts, reasons, usage = streamed(chunks, lambda c: c.delta.content)
    assert texts == {c.index: c.message.content for c in out.choices}
    assert set(reasons.values()) == {"length"} and len(reasons) == 3
    assert usage.prompt_tokens == out.usage.prompt_tokens and usage.completion_tokens == 3 * 8


def test_chat_n_with_an_image(client):
    content = [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": data_url(random_image(9, (32, 24)))}},
    ]
    messages = [{"role": "user", "content": content}]
    greedy = {"max_tokens": 6, "temperature": 0}
    out = client.chat.completions.create(model=MODEL, messages=messages, n=2, **greedy)
    alone = client.chat.completions.create(model=MODEL, messages=messages, **greedy)
    assert [c.message.content for c in out.choices] == [alone.choices[0].message.content] * 2


def test_best_of_returns_the_most_likely_sequences(client):
    every = client.completions.create(model=MODEL, prompt=PROMPT, n=4, logprobs=0, **SAMPLED)
    ranked = sorted(every.choices, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    best = client.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=4, **SAMPLED)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)  # ranked by them, not asked for
    assert best.usage.completion_tokens == 4 * 8  # every sequence sampled counts


@pytest.mark.parametrize(
    ("path", "fields", "param", "needle"),
    [
        ("completions", {"n": MAX_N + 1}, "n", "less than or equal"),
        ("chat/completions", {"n": MAX_N + 1}, "n", "less than or equal"),
        ("completions", {"n": 3, "best_of": 2}, "best_of", "best_of (2) must be at least n (3)"),
        ("completions", {"best_of": 2, "stream": True}, "best_of", "cannot be streamed"),
        ("completions", {"n": 100, "max_tokens": 400}, "n", "KV cache"),
        ("completions", {"best_of": 100, "max_tokens": 400}, "best_of", "KV cache"),
        ("chat/completions", {"n": 100}, "n", "KV cache"),
    ],
)
def test_refusals_name_the_field(base_url, path, fields, param, needle):
    body = {"model": MODEL, **fields}
    body.update({"prompt": PROMPT} if path == "completions" else {"messages": MESSAGES})
    response = httpx.post(f"{base_url}/v1/{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["param"] == param


def test_leaving_an_n_stream_aborts_every_sequence(base_url, cluster):
    baseline = live_object_ids()
    body = {"model": MODEL, "prompt": "go on", "n": 4, "max_tokens": 200, "stream": True,
            "ignore_eos": True}  # fmt: skip
    url = f"{base_url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        lines = response.iter_lines()
        received = [line for _, line in zip(range(12), lines) if line.startswith("data:")]
    assert received  # the client saw tokens, then went away
    assert_clean(cluster, baseline)
