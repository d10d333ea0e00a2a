"""The OpenAI-compatible gateway, driven by real clients over loopback HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from pdcluster.cluster.api.app import create_app
from pdcluster.cluster.config import GatewaySettings
from pdcluster.engine import LLM, SamplingParams
from tests.cluster_utils import SMALL_ENGINE, assert_clean, live_object_ids, random_image, start
from tests.gateway_utils import data_url, running

openai = pytest.importorskip("openai")

MODEL = "tiny-llava"
NO_EOS = {"ignore_eos": True}
CHAT_BODY = {"messages": [{"role": "user", "content": "Hi!"}]}


@pytest.fixture(scope="module")
def cluster(ray_session, model_dir):
    gateway = {"served_model_name": MODEL}
    with start(model_dir, encoder=1, prefill=1, decode=1, gateway=gateway) as c:
        yield c


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model_dir, **SMALL_ENGINE)

    def generate(prompt, max_tokens: int) -> str:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return llm.generate(prompt, params)[0].text

    return generate


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_matches_offline_engine(client, reference):
    out = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=12, temperature=0, extra_body=NO_EOS
    )
    assert out.choices[0].text == reference("Hello there", 12)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens > 0


def test_completion_batch_and_token_prompt(client, reference):
    out = client.completions.create(
        model=MODEL, prompt=["one", "two three"], max_tokens=5, temperature=0, extra_body=NO_EOS
    )
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [
        reference("one", 5),
        reference("two three", 5),
    ]
    ids = client.completions.create(model=MODEL, prompt=[9, 10, 11], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3


def test_completion_streaming(client, reference):
    stream = client.completions.create(
        model=MODEL,
        prompt="Stream me",
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_EOS,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference("Stream me", 10)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_and_logprobs(client, cluster):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
        extra_body=NO_EOS,
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 6
    assert all(lp.logprob <= 0 for lp in choice.logprobs.content)
    expected = cluster.tokenizer.encode_chat(messages)
    assert out.usage.prompt_tokens == len(expected)


def test_stream_interval_sends_fewer_chunks_of_the_same_text(cluster, client):
    """gateway.stream_interval 4: after the first token, chunks of at least 4 tokens (but
    the last); the same text and logprobs as token-by-token streaming."""

    def stream(through) -> tuple[list[int], str, list[float]]:
        chunks = through.chat.completions.create(
            model=MODEL, messages=CHAT_BODY["messages"], max_tokens=10, temperature=0,
            logprobs=True, stream=True, extra_body=NO_EOS,
        )  # fmt: skip
        chunks = [c for c in chunks if c.choices and c.choices[0].logprobs]
        entries = [e for c in chunks for e in c.choices[0].logprobs.content]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        return [len(c.choices[0].logprobs.content) for c in chunks], text, entries

    app = create_app(cluster, GatewaySettings(stream_interval=4), MODEL, cluster.max_model_len)
    with running(app) as url:
        gathered = stream(openai.OpenAI(base_url=f"{url}/v1", api_key="unused"))
    each = stream(client)
    counts = gathered[0]
    assert counts[0] == 1 and sum(counts) == 10 and len(counts) <= 4
    assert all(n >= 4 for n in counts[1:-1])  # (token by token may coalesce too: under load
    # a pull carries the tokens of several steps, so its chunk count proves nothing)
    assert gathered[1] == each[1]  # the text
    assert [e.token for e in gathered[2]] == [e.token for e in each[2]]
    assert [e.logprob for e in gathered[2]] == pytest.approx([e.logprob for e in each[2]], abs=1e-4)


def test_chat_streaming_with_image(client, model_dir, reference, cluster):
    image = random_image(5, (48, 36))
    content = [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": data_url(image)}},
    ]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body=NO_EOS,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    template = [
        {"role": "user", "content": [{"type": "text", "text": "What is in "}, {"type": "image"}]}
    ]
    ids = cluster.tokenizer.encode_chat(template)
    assert text == reference({"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, 8)
    jpeg = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image.convert("RGB"), "JPEG")}}]}],
        max_tokens=3,
    )  # fmt: skip
    assert jpeg.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"model": MODEL, "prompt": ""}, 400, "empty"),
        ({"model": MODEL, "prompt": 5}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "context length"),
        ({"model": MODEL, "prompt": "x " * 3000}, 400, "context length"),
        ({"model": MODEL, "prompt": "x" * 4_000_000}, 400, "characters"),  # never tokenized
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "prompt": "x", "min_p": 2}, 400, "min_p"),
        ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
        ({"prompt": "x"}, 400, "model"),
    ],
)
def test_completion_errors_are_openai_shaped_4xx(base_url, body, status, needle):
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"] and error["type"]


@pytest.mark.parametrize(
    ("path", "fields", "message"),
    [
        ("completions", {"n": 2, "best_of": 1}, "best_of (1) must be at least n (2)"),
        ("completions", {"stream": True, "best_of": 3}, "best_of > n cannot be streamed"),
        ("completions", {"suffix": "end"}, "suffix is not supported"),
        ("chat", {"top_logprobs": 3}, "top_logprobs needs logprobs: true"),
        ("chat", {"stream_options": {"include_usage": True}}, "stream_options is only allowed"),
    ],
)
def test_unsupported_parameters_are_named(base_url, path, fields, message):
    body = {"model": MODEL, "max_tokens": 1, **fields}
    body.update({"prompt": "x"} if path == "completions" else CHAT_BODY)
    response = httpx.post(f"{base_url}/v1/{path.replace('chat', 'chat/completions')}", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"].startswith(message) and error["param"] == next(reversed(fields))
    assert error["code"] in ("unsupported_value", "invalid_value")


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("completions", "presence_penalty", 2.5),
        ("chat", "frequency_penalty", -3),
        ("chat", "repetition_penalty", 0),
        ("chat", "repetition_penalty", 1e-300),  # positive logits would overflow
        ("completions", "logit_bias", {"abc": 1}),
        ("completions", "logit_bias", {"-1": 1}),
        ("chat", "logit_bias", {"5": 101}),
        ("completions", "logit_bias", {"10000000": 1}),  # outside the vocabulary
        ("completions", "logprobs", 21),
        ("chat", "top_logprobs", 21),
    ],
)
def test_bad_sampling_values_are_a_400_naming_the_field(base_url, path, field, value):
    body = {"model": MODEL, "max_tokens": 1, field: value}
    body.update({"prompt": "x"} if path == "completions" else {**CHAT_BODY, "logprobs": True})
    response = httpx.post(f"{base_url}/v1/{path.replace('chat', 'chat/completions')}", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]


def test_penalties_and_logit_bias_match_the_offline_engine(client, model_dir):
    """Through the disaggregated cluster, greedy with penalties and bias is what one
    colocated engine produces; the penalties change the output."""
    llm = LLM(model_dir, **SMALL_ENGINE)
    prompt = "Tell me a story"
    first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]
    fields = {"presence_penalty": 0.5, "frequency_penalty": 1.5, "logit_bias": {str(first): 6}}
    extra = {"repetition_penalty": 1.2, **NO_EOS}
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra, **fields
    )
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=0.5,
        frequency_penalty=1.5, repetition_penalty=1.2, logit_bias={first: 6.0},
    )  # fmt: skip
    expected = llm.generate(prompt, params)[0].text
    assert out.choices[0].text == expected
    unpenalized = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert expected != llm.generate(prompt, unpenalized)[0].text
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0, logit_bias={str(first): 100},
        extra_body=NO_EOS, **CHAT_BODY,
    )  # fmt: skip
    assert chat.choices[0].message.content == llm.tokenizer.decode([first] * 6)


def test_top_logprobs_on_both_endpoints(client):
    out = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=5, logprobs=3, temperature=0,
        extra_body=NO_EOS,
    )  # fmt: skip
    lp = out.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == 5
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == token_lp  # greedy: the likeliest
        assert token_lp == max(top.values())
    stream = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=5, logprobs=3, temperature=0,
        stream=True, extra_body=NO_EOS,
    )  # fmt: skip
    streamed = [
        t for c in stream if c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs
    ]
    assert streamed == lp.top_logprobs
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=4, logprobs=True, top_logprobs=2, temperature=0,
        extra_body=NO_EOS, **CHAT_BODY,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=4, logprobs=True, top_logprobs=2, temperature=0, stream=True,
        extra_body=NO_EOS, **CHAT_BODY,
    )  # fmt: skip
    streamed = [e for c in stream if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [
        [t.token for t in e.top_logprobs] for e in content
    ]


def test_echo_prepends_the_prompt(client, reference, cluster):
    out = client.completions.create(
        model=MODEL, prompt=["Echo this", "and this"], max_tokens=4, temperature=0, echo=True,
        extra_body=NO_EOS,
    )  # fmt: skip
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert texts == [p + reference(p, 4) for p in ("Echo this", "and this")]
    stream = client.completions.create(
        model=MODEL, prompt="Echo this", max_tokens=4, temperature=0, echo=True, stream=True,
        extra_body=NO_EOS,
    )  # fmt: skip
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert chunks[0] == "Echo this" and "".join(chunks) == texts[0]
    ids = client.completions.create(model=MODEL, prompt=[9, 10, 11], max_tokens=1, echo=True)
    echoed = cluster.tokenizer.decode([9, 10, 11], skip_special_tokens=False)
    assert ids.choices[0].text.startswith(echoed) and len(ids.choices[0].text) > len(echoed)


def test_supported_values_of_unsupported_parameters_are_accepted(client):
    defaults = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}
    out = client.completions.create(
        model=MODEL, prompt="x", max_tokens=1, echo=False, best_of=1, **defaults,
        extra_body={"repetition_penalty": 1.0},
    )  # fmt: skip
    assert len(out.choices) == 1
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=1, logprobs=True, top_logprobs=0, **defaults, **CHAT_BODY
    )
    assert len(chat.choices[0].logprobs.content) == 1


def test_streamed_logprobs(client):
    stream = client.completions.create(
        model=MODEL, prompt="Stream me", max_tokens=5, logprobs=0, stream=True, extra_body=NO_EOS
    )
    chunks = [c.choices[0] for c in stream]
    lps = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
    assert len(lps) == 5 and all(lp <= 0 for lp in lps)
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in chunks)
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=5, logprobs=True, stream=True, extra_body=NO_EOS, **CHAT_BODY
    )
    content = [lp for c in stream if c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert len(content) == 5 and all(lp.logprob <= 0 for lp in content)


def test_batches_of_prompts_are_bounded(base_url, cluster):
    limit = GatewaySettings().max_batch_prompts
    body = {"model": MODEL, "prompt": ["x"] * (limit + 1), "max_tokens": 1}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert f"at most {limit} prompts" in error["message"] and error["param"] == "prompt"
    # Every prompt of a batch is checked against the context length.
    too_long = [[9, 10], [9] * (cluster.max_model_len + 1)]
    body = {"model": MODEL, "prompt": too_long, "max_tokens": 1}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and "context length" in response.json()["error"]["message"]

    settings = GatewaySettings(max_batch_prompts=2)
    with running(create_app(cluster, settings, MODEL, cluster.max_model_len)) as url:
        body = {"model": MODEL, "prompt": [[9, 10]] * 3, "max_tokens": 1, "stream": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 400 and "at most 2 prompts" in response.text
        body["prompt"] = [[9, 10], [11]]
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"model": "tiny-llava", "prompt": "x", "temperature": NaN}', "NaN"),
        (b"\xff\xfe garbage", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b"[" * 100_000 + b"]" * 100_000, "JSON"),
    ],
)
def test_malformed_bodies(base_url, raw, needle):
    response = httpx.post(
        f"{base_url}/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert needle in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("data:image/png;base64,!!!notbase64", "base64"),
        ("data:image/png;base64,aGVsbG8=", "not a valid image"),
        ("http://example.com/cat.png", "allow-listed"),
        ("file:///etc/passwd", "allow-listed"),
    ],
)
def test_bad_images_are_refused(base_url, url, needle):
    body = {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
        ],
    }
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert needle in response.json()["error"]["message"]


def test_disconnect_mid_stream_aborts_everywhere(base_url, cluster):
    baseline = live_object_ids()
    body = {"model": MODEL, "prompt": "go on", "max_tokens": 400, "stream": True, **NO_EOS}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        received = [line for _, line in zip(range(6), lines) if line.startswith("data:")]
    assert received  # the client saw tokens, then went away
    assert_clean(cluster, baseline)


def test_cluster_health_and_metrics(base_url, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    view = httpx.get(f"{base_url}/v1/cluster").json()["instances"]
    assert {i["role"] for i in view} == {"encoder", "prefill", "decode"}
    assert all(i["num_blocks_free"] == i["num_blocks_total"] for i in view)
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{base_url}/metrics").text
    for name in (
        f'vllm:time_to_first_token_seconds_bucket{{le="0.001",model_name="{MODEL}"}}',
        "vllm:inter_token_latency_seconds_bucket{",
        f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}}',
        "vllm:kv_cache_usage_perc{",
        "pdcluster_num_deferred{",
        "pdcluster_kv_transfer_bytes_total{",
        "pdcluster_kv_leases_expired_total{",
        "pdcluster_kv_transfer_latency_seconds_bucket{",
    ):
        assert name in text


def test_api_key(cluster):
    settings = GatewaySettings(api_key="s3cret")
    app = create_app(cluster, settings, MODEL, cluster.max_model_len)
    with running(app) as url:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        response = httpx.post(f"{url}/v1/completions", json=body, headers=wrong)
        assert response.status_code == 401 and "API key" in response.json()["error"]["message"]
        ok = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret")
        assert ok.completions.create(model=MODEL, prompt="x", max_tokens=1).choices


def test_body_size_limit(cluster):
    app = create_app(cluster, GatewaySettings(max_body_bytes=2048), MODEL, cluster.max_model_len)
    with running(app) as url:
        body = json.dumps({"model": MODEL, "prompt": "y" * 5000})
        response = httpx.post(f"{url}/v1/completions", content=body)
        assert response.status_code == 413


def test_chat_text_too_long_for_the_context_is_refused_before_tokenizing(base_url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "y" * 4_000_000}]}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert "characters" in response.json()["error"]["message"]


# ---- chat content: parts or strings, as the model's template takes them ------------------

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
)


def test_chat_template_content_format_is_detected():
    from pdcluster.engine.preset_tokenizer import chat_template
    from pdcluster.engine.tokenizer import chat_template_takes_content_parts

    assert not chat_template_takes_content_parts(CHATML)
    assert chat_template_takes_content_parts(chat_template(allow_images=True, add_bos=True))
    loop = "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}"
    assert chat_template_takes_content_parts(loop)


@pytest.fixture(scope="module")
def gateway_with_template(cluster, model_dir, tmp_path_factory):
    """Factory: the base URL of a gateway over `cluster` whose tokenizer (same vocabulary)
    renders chats with the given template."""
    import shutil
    from contextlib import ExitStack

    from pdcluster.engine.tokenizer import Tokenizer

    class WithTokenizer:  # the cluster, seen through another chat template
        def __init__(self, tokenizer: Tokenizer) -> None:
            self.tokenizer = tokenizer

        def __getattr__(self, name: str):
            return getattr(cluster, name)

    stack = ExitStack()

    def start_gateway(template: str) -> tuple[str, Tokenizer]:
        folder = tmp_path_factory.mktemp("template")
        for source in Path(model_dir).glob("*.json"):  # tokenizer and configs, no weights
            shutil.copy(source, folder)
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
        tokenizer = Tokenizer(folder)
        app = create_app(WithTokenizer(tokenizer), GatewaySettings(), MODEL, cluster.max_model_len)
        return stack.enter_context(running(app)), tokenizer

    with stack:
        yield start_gateway


def test_text_parts_are_joined_for_a_template_that_takes_strings(gateway_with_template):
    url, tokenizer = gateway_with_template(CHATML)
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": parts}]}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    expected = tokenizer.encode("<|im_start|>user\nHello\nworld<|im_end|>\n", False)
    assert response.json()["usage"]["prompt_tokens"] == len(expected)


def test_image_part_for_a_template_that_takes_strings_is_a_400(gateway_with_template):
    url, _ = gateway_with_template(CHATML)
    image = {"type": "image_url", "image_url": {"url": data_url(random_image(1, (8, 8)))}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [image]}]}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert "takes text content only" in response.json()["error"]["message"]


def test_a_template_that_fails_while_rendering_is_a_400(gateway_with_template):
    url, _ = gateway_with_template("{{ messages[0]['content'] + 1 }}")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert "chat template failed" in response.json()["error"]["message"]


# ---- vLLM's extra endpoints ----------------------------------------------------------------


def test_model_card_by_id(base_url):
    card = httpx.get(f"{base_url}/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] > 0
    response = httpx.get(f"{base_url}/v1/models/gpt-4")
    assert response.status_code == 404
    error = response.json()["error"]
    assert "'gpt-4' does not exist" in error["message"] and error["code"] == "model_not_found"


def test_tokenize_and_detokenize(base_url, cluster):
    tokenizer = cluster.tokenizer
    out = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": "Hello there"}).json()
    assert out["tokens"] == tokenizer.encode("Hello there")
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == cluster.max_model_len
    bare = {"prompt": "Hello there", "add_special_tokens": False}
    tokens = httpx.post(f"{base_url}/tokenize", json=bare).json()["tokens"]
    assert tokens == tokenizer.encode("Hello there", add_special_tokens=False)
    messages = CHAT_BODY["messages"]
    chat = httpx.post(f"{base_url}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode_chat(messages)
    body = {"messages": messages, "add_generation_prompt": False}
    no_cue = httpx.post(f"{base_url}/tokenize", json=body).json()["tokens"]
    assert no_cue == tokenizer.encode_chat(messages, add_generation_prompt=False)

    back = httpx.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": tokens}).json()
    assert back == {"prompt": "Hello there"}


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("tokenize", {"prompt": "x", "messages": CHAT_BODY["messages"]}, 400, "either prompt"),
        ("tokenize", {}, 400, "either prompt"),
        ("tokenize", {"prompt": "x", "add_special_tokens": "maybe"}, 400, "add_special_tokens"),
        ("tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
        ("detokenize", {"tokens": [-1]}, 400, "-1 is not a token id"),
        ("detokenize", {"tokens": [5, 10**9]}, 400, "1000000000 is not a token id"),
        ("detokenize", {"tokens": "5"}, 400, "tokens"),
    ],
)
def test_tokenize_errors(base_url, path, body, status, needle):
    response = httpx.post(f"{base_url}/{path}", json=body)
    assert response.status_code == status
    assert needle in response.json()["error"]["message"]


def test_unknown_fields_are_accepted_as_vllm_does(base_url):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "bogus_field": 1, "ignore_eos": True}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    response = httpx.post(f"{base_url}/tokenize", json={"prompt": "x", "bogus": 1})
    assert response.status_code == 200 and response.json()["count"] >= 1


def test_version(base_url):
    import pdcluster

    assert httpx.get(f"{base_url}/version").json() == {"version": pdcluster.__version__}


def test_api_key_covers_the_new_endpoints(cluster):
    app = create_app(cluster, GatewaySettings(api_key="s3cret"), MODEL, cluster.max_model_len)
    key = {"Authorization": "Bearer s3cret"}
    with running(app) as url:
        for method, path, body in [
            ("GET", f"/v1/models/{MODEL}", None),
            ("POST", "/tokenize", {"prompt": "x"}),
            ("POST", "/detokenize", {"tokens": [5]}),
            ("GET", "/version", None),
        ]:
            assert httpx.request(method, url + path, json=body).status_code == 401
            assert httpx.request(method, url + path, json=body, headers=key).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200
