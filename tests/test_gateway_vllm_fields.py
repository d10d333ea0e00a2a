"""vLLM's request fields through the real gateway of a live 1P1D cluster, sent as an
unmodified openai client sends them (`extra_body`): each one's effect, the no-op and
unknown fields accepted and logged, and values we cannot honour refused by name."""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest

from tests.cluster_utils import assert_clean, live_object_ids, start

openai = pytest.importorskip("openai")

MODEL = "tiny-llava"
GREEDY = {"temperature": 0, "max_tokens": 10, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "Hi there!"}]
# A template that shows what it was given: the kwargs, the documents, reasoning_effort.
TEMPLATE = (
    "{{ reasoning_effort }}|{% for d in documents %}{{ d.title }};{% endfor %}|"
    "{{ enable_thinking }}|{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def cluster(ray_session, model_dir):
    with start(model_dir, prefill=1, decode=1, gateway={"served_model_name": MODEL}) as c:
        baseline = live_object_ids()
        yield c
        assert_clean(c, baseline)


@pytest.fixture(scope="module")
def tokenizer(cluster):
    return cluster.tokenizer


def complete(client, prompt="The quick brown fox", **fields):
    extra = {**GREEDY["extra_body"], **fields.pop("extra_body", {})}
    return client.completions.create(
        model=MODEL, prompt=prompt, **{**GREEDY, **fields, "extra_body": extra}
    )


def token_ids_of(choice) -> list[int]:
    """The sampled ids, from logprob tokens sent as "token_id:N"."""
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def ids_of(client, prompt="The quick brown fox", **extra) -> list[int]:
    body = {"return_tokens_as_token_ids": True, **extra}
    return token_ids_of(complete(client, prompt, logprobs=0, extra_body=body).choices[0])


def test_return_tokens_as_token_ids(client):
    out = complete(client, logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    logprobs = out.choices[0].logprobs
    assert all(re.fullmatch(r"token_id:\d+", t) for t in logprobs.tokens)
    assert all(re.fullmatch(r"token_id:\d+", t) for top in logprobs.top_logprobs for t in top)
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    assert all(e.token.startswith("token_id:") for e in chat.choices[0].logprobs.content)


def test_allowed_token_ids_and_bad_words(client, tokenizer):
    allowed = [5, 17, 300, 1000]
    sampled = ids_of(client, temperature=1.0, seed=3, allowed_token_ids=allowed)
    assert set(sampled) <= set(allowed)
    plain = ids_of(client)

    def word_of(token: int) -> str | None:
        """The token's text, if alone or after a space it tokenizes back to just this token."""
        word = tokenizer.decode([token]).strip()
        spelled = [tokenizer.encode(s + word, add_special_tokens=False) for s in ("", " ")]
        return word if word and [token] in spelled else None

    token = next(t for t in plain if word_of(t))
    banned = ids_of(client, bad_words=[word_of(token)])
    assert token in plain and token not in banned


def test_min_p_one_is_greedy(client):
    """min_p 1 keeps only the likeliest token: sampling at any temperature is greedy."""
    plain = ids_of(client)
    assert ids_of(client, temperature=1.5, seed=11, min_p=1.0) == plain


def test_stop_string_kept_with_include_stop_str_in_output(client):
    text = complete(client).choices[0].text
    stop = text[3:6]
    cut = complete(client, stop=[stop]).choices[0]
    kept = complete(client, stop=[stop], extra_body={"include_stop_str_in_output": True}).choices[0]
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + stop and kept.text.endswith(stop)


def test_special_tokens_in_the_text(client, tokenizer):
    eos = tokenizer.eos_token_ids[0]
    eos_text = tokenizer.id_to_token(eos)
    bias = {"logit_bias": {str(eos): 100}, "max_tokens": 2}
    assert complete(client, **bias).choices[0].text == ""
    kept = complete(client, **bias, extra_body={"skip_special_tokens": False})
    assert kept.choices[0].text == f" {eos_text} {eos_text}"
    tight = {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    assert complete(client, **bias, extra_body=tight).choices[0].text == eos_text * 2


def test_prompt_truncation_and_special_tokens(client, tokenizer):
    prompt = "one two three four five six seven"
    full = complete(client, prompt, max_tokens=1).usage.prompt_tokens
    assert full == len(tokenizer.encode(prompt))
    truncated = complete(client, prompt, extra_body={"truncate_prompt_tokens": 3})
    assert truncated.usage.prompt_tokens == 3
    tail = tokenizer.encode(prompt)[-3:]
    assert truncated.choices[0].text == complete(client, tail).choices[0].text
    bare = complete(client, prompt, max_tokens=1, extra_body={"add_special_tokens": False})
    assert bare.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert bare.usage.prompt_tokens < full  # no BOS


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"structured_outputs": {"choice": ["yes", "no"]}}, r"yes|no"),
        ({"guided_choice": ["red", "green"]}, r"red|green"),
        ({"structured_outputs": {"regex": r"[0-9]{2}-[a-z]{2}"}}, r"[0-9]{2}-[a-z]{2}"),
        ({"guided_regex": r"[ab]{4}"}, r"[ab]{4}"),
        ({"guided_grammar": 'start: "x=" /[0-9]/'}, r"x=[0-9]"),
        ({"guided_json": {"type": "integer"}}, r"-?[0-9]+"),
    ],
)
def test_structured_outputs_and_guided_aliases(client, fields, pattern):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, temperature=1.0, seed=1, extra_body=fields
    )
    assert re.fullmatch(pattern, out.choices[0].message.content), out.choices[0].message.content


def test_two_grammars_and_a_bad_one_are_refused(base_url):
    both = {"guided_regex": "a", "response_format": {"type": "json_object"}}
    for extra, needle in ((both, "only one of"), ({"guided_regex": "("}, "guided_regex")):
        body = {"model": MODEL, "messages": MESSAGES, **extra}
        response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400 and needle in response.json()["error"]["message"]


def test_continuous_usage_stats(client):
    stream = client.completions.create(
        model=MODEL, prompt="Stream me", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "ignore_eos": True,
        },
    )  # fmt: skip
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 6 == chunks[-1].usage.completion_tokens
    plain = client.completions.create(
        model=MODEL, prompt="x", max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    usages = [c.usage for c in plain]
    assert usages[-1] is not None and all(u is None for u in usages[:-1])


def test_chat_template_fields_reach_the_template(client, tokenizer):
    def prompt_tokens(**extra) -> int:
        out = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1,
            extra_body={"chat_template": TEMPLATE, **extra},
        )  # fmt: skip
        return out.usage.prompt_tokens

    def tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    rendered = "high|Doc A;Doc B;|False|user: Hi there!\nassistant:"
    sent = {
        "reasoning_effort": "high",
        "documents": [{"title": "Doc A", "text": "a"}, {"title": "Doc B", "text": "b"}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert prompt_tokens(**sent) == tokens(rendered)
    assert prompt_tokens(**sent, add_generation_prompt=False) == tokens(
        rendered[: -len("assistant:")]
    )


def test_continue_final_message(client, tokenizer):
    messages = [*MESSAGES, {"role": "assistant", "content": "Sure, the answer"}]
    extra = {"add_generation_prompt": False}
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body=extra
    )
    continued = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1,
        extra_body={**extra, "continue_final_message": True},
    )  # fmt: skip
    assert continued.usage.prompt_tokens < whole.usage.prompt_tokens  # no end of turn after it
    text = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages], False
    )
    cut = text[: text.rfind("Sure, the answer") + len("Sure, the answer")]
    assert continued.usage.prompt_tokens == len(tokenizer.encode(cut, add_special_tokens=False))


def test_request_id_and_header_name_the_response_and_log_lines(base_url, caplog):
    caplog.set_level(logging.INFO, logger="pdcluster.cluster.api.serving")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "request_id": "my-req-1"}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert response.json()["id"] == "cmpl-my-req-1"
    assert response.headers["x-request-id"] == "cmpl-my-req-1"
    headers = {"X-Request-Id": "from-header"}
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "request_id": "ignored"}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=chat, headers=headers, timeout=60)
    assert response.json()["id"] == "chatcmpl-from-header"
    logged = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("cmpl-my-req-1:") for m in logged)
    assert any(m.startswith("chatcmpl-from-header:") for m in logged)


def test_no_op_and_unknown_fields_are_accepted_and_logged_once(base_url, caplog):
    caplog.set_level(logging.WARNING, logger="pdcluster.cluster.api.serving")
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "x", "mood": "calm"}],
        "max_tokens": 1, "store": True, "metadata": {"a": "b"}, "service_tier": "auto",
        "modalities": ["text"], "user": "u1", "vllm_xargs": {"k": 1},
        "mm_processor_kwargs": {"num_crops": 2}, "parallel_tool_calls": False,
        "frobnicate": 3, "stream": True, "stream_options": {"include_usage": True, "extra": 1},
        "request_id": "noop",
    }  # fmt: skip
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    warnings = [r.getMessage() for r in caplog.records if "chatcmpl-noop" in r.getMessage()]
    assert len(warnings) == 1
    for name in ("store", "metadata", "service_tier", "modalities", "user", "vllm_xargs",
                 "mm_processor_kwargs", "frobnicate", "stream_options.extra", "messages.0.mood"):  # fmt: skip
        assert name in warnings[0]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"n": 10_000}, "n:"),
        ({"min_p": 2}, "min_p:"),
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"chat_template": "{% for %}"}, "chat template"),
    ],
)
def test_values_we_cannot_honour_are_a_400_naming_the_field(base_url, extra, needle):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, **extra}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


def test_langchain_chat_openai_with_vllm_fields(base_url, client):
    """LangChain's ChatOpenAI, as RAG and agent code calls it, passes vLLM's fields through
    `extra_body`: its answer is the openai client's, whole and streamed."""
    langchain_openai = pytest.importorskip("langchain_openai")
    extra = {"min_p": 0.05, "cache_salt": "tenant-a", "ignore_eos": True}
    llm = langchain_openai.ChatOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=8,
        extra_body=extra,
    )  # fmt: skip
    messages = [("system", "Be brief."), ("user", "Hi there!")]
    answer = llm.invoke(messages)
    direct = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": r, "content": c} for r, c in messages],
        temperature=0,
        max_tokens=8,
        extra_body=extra,
    )
    assert answer.content == direct.choices[0].message.content
    assert answer.response_metadata["finish_reason"] == "length"
    assert answer.usage_metadata["output_tokens"] == 8
    assert "".join(chunk.content for chunk in llm.stream(messages)) == answer.content


# guidellm's requests, field for field (its openai_http backend, synthetic text data): the
# default-suite twin of test_guidellm.py, which runs guidellm itself against `serve`.
GUIDELLM_STREAM = {
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "stop": None,
    "ignore_eos": True,
}
GUIDELLM_BODIES = {
    "/v1/completions": {"prompt": "one two three four five", "max_tokens": 7},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "one two three"}]}],
        "max_completion_tokens": 7,
    },
}


@pytest.mark.parametrize("path", GUIDELLM_BODIES)
def test_guidellm_requests_stream_every_usage_and_the_asked_length(base_url, path):
    body = {"model": MODEL, **GUIDELLM_STREAM, **GUIDELLM_BODIES[path]}
    with httpx.stream("POST", f"{base_url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data:")) for line in lines[:-1]]
    # guidellm keeps the last usage it reads and counts output tokens from it.
    assert all(chunk.get("usage") for chunk in chunks)
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 7 and usage["prompt_tokens"] > 0
    # Completions stream `text`; chat streams `delta.content`, the first delta the role alone.
    choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
    text = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choices)
    assert text


def test_auto_tool_choice_without_the_servers_flags_is_vllms_400(base_url, caplog):
    """As vLLM: tools with tool_choice "auto" (their default) need --enable-auto-tool-choice
    and --tool-call-parser; the refusal is logged once with the request id and the field."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    with caplog.at_level(logging.INFO, logger="pdcluster.cluster.api.errors"):
        response = httpx.post(f"{base_url}/v1/chat/completions", json=body,
                              headers={"X-Request-Id": "auto-1"}, timeout=60)  # fmt: skip
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and "--enable-auto-tool-choice" in error["message"]
    [line] = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert "request auto-1, field tool_choice" in line and "--tool-call-parser" in line
