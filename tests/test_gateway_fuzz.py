"""Hostile input against the gateway of a live 1E1P1D cluster.

Bodies come from the gateway's own OpenAPI document (schemathesis, valid and invalid per the
schema) and from generic mutations of valid bodies (wrong types at any depth, unknown and
missing fields, broken JSON text); explicit cases cover the classic attacks. The property
throughout: no response is a 5xx, every 4xx carries an OpenAI-shaped error, and afterwards
the cluster still serves and holds nothing.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import struct
import zlib
from typing import Any

import httpx
import pytest
from PIL import Image

from pdcluster.cluster.api.app import create_app
from pdcluster.cluster.config import GatewaySettings
from pdcluster.cluster.replicas import gateway_app
from tests.cluster_utils import assert_clean, live_object_ids, random_image, start
from tests.gateway_utils import data_url, running

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

MODEL = "tiny-llava"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_FUZZ_TOKENS = 3  # generated bodies the cluster accepts finish fast
FUZZ_EXAMPLES = 50  # per strategy in the default run (six strategies)
SLOW_FUZZ_EXAMPLES = 600


@pytest.fixture(scope="module")
def cluster(ray_session, preset_dir):
    gateway = {"served_model_name": MODEL}
    with start(preset_dir("tiny-llava"), encoder=1, prefill=1, decode=1, gateway=gateway) as c:
        yield c


@pytest.fixture(scope="module")
def baseline(cluster):
    return live_object_ids()


@pytest.fixture(scope="module")
def base_url(cluster, baseline):
    with running(gateway_app(cluster)) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as client:
        yield client


# ---- the property ------------------------------------------------------------------------
def check(response: httpx.Response) -> None:
    """No 5xx; a 4xx is OpenAI-shaped; a 200 is a complete, error-free answer."""
    status, text = response.status_code, response.text
    assert status < 500, f"{status}: {text[:1000]}"
    if status >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], text
        assert isinstance(error["type"], str) and error["type"], text
        assert {"param", "code"} <= set(error), text
        return
    assert status == 200, text[:1000]
    if not response.request.url.path.endswith("completions"):
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", text[-1000:]
        choices = [c for e in events[:-1] for c in json.loads(e)["choices"]]
    else:
        choices = response.json()["choices"]
    reasons = [c["finish_reason"] for c in choices if c["finish_reason"]]
    assert reasons and set(reasons) <= {"length", "stop"}, text[-1000:]


def post(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = http.post(path, content=content, headers={"content-type": "application/json"})
    check(response)
    return response


def assert_serves_and_clean(http: httpx.Client, cluster, baseline: set[str]) -> None:
    body = {"model": MODEL, "prompt": "still there?", "max_tokens": 4, "ignore_eos": True}
    response = post(http, COMPLETIONS, body)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    assert_clean(cluster, baseline)


# ---- generated bodies ----------------------------------------------------------------------
def _tame(body: Any, keep_model: bool) -> Any:
    """Keep generated bodies quick to serve: our model name (mostly), few tokens."""
    if not isinstance(body, dict):
        return body
    if keep_model and isinstance(body.get("model"), str):
        body["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = body.get(key)
        if type(value) is int and 0 <= value <= 100_000:
            body[key] = min(value, MAX_FUZZ_TOKENS if key != "min_tokens" else 1)
    if not any(type(body.get(k)) is int for k in ("max_tokens", "max_completion_tokens")):
        body.setdefault("max_tokens", MAX_FUZZ_TOKENS)
    return body


def schema_cases(base_url: str, path: str, mode: Any) -> Any:
    """Cases for one endpoint from the gateway's served OpenAPI document."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    cases = schema[path]["POST"].as_strategy(generation_mode=mode)
    keep_model = st.sampled_from([True, True, True, False])
    return st.tuples(cases, keep_model).map(lambda pair: (path, _tame(pair[0].body, pair[1])))


def _valid_bodies() -> list[tuple[str, dict[str, Any]]]:
    image = data_url(random_image(7, (24, 18)))
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": image}}]
    return [
        (COMPLETIONS, {"model": MODEL, "prompt": "fuzz me", "max_tokens": 2, "stop": ["x"]}),
        (COMPLETIONS, {"model": MODEL, "prompt": [[5, 6], [7]], "max_tokens": 2, "seed": 3}),
        (
            CHAT,
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": parts},
                ],
                "max_completion_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
    ]


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every location inside a JSON value, itself included."""
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else []
    )
    return [prefix] + [p for key, child in items for p in _paths(child, (*prefix, key))]


def _mutate(data: Any, body: Any) -> Any:
    """One generic mutation somewhere in `body` (a JSON value), drawn from `data`."""
    where = data.draw(st.sampled_from(_paths(body)))
    op = data.draw(st.sampled_from(["replace", "delete", "unknown", "wrap_list", "wrap_dict"]))
    if not where:
        return data.draw(JSON_VALUES) if op == "replace" else [body] if op == "wrap_list" else body
    parent = body
    for key in where[:-1]:
        parent = parent[key]
    key, old = where[-1], parent[where[-1]]
    if op == "replace":
        parent[key] = data.draw(JSON_VALUES)
    elif op == "delete":
        del parent[key]
    elif op == "unknown" and isinstance(old, dict):
        old[data.draw(st.text(min_size=1, max_size=8))] = data.draw(JSON_VALUES)
    elif op == "wrap_list":
        parent[key] = [old]
    else:
        parent[key] = {"value": old}
    return body


def _corrupt_text(data: Any, text: bytes) -> bytes:
    """Byte-level damage to serialized JSON: a cut, a flipped byte, or an inserted token."""
    at = data.draw(st.integers(0, len(text)))
    op = data.draw(st.sampled_from(["cut", "flip", "insert"]))
    if op == "cut":
        return text[:at]
    if op == "flip" and at < len(text):
        return text[:at] + bytes([text[at] ^ data.draw(st.integers(1, 255))]) + text[at + 1 :]
    token = data.draw(
        st.sampled_from([b"NaN", b"-Infinity", b"1e999", b"\xff", b'"\\ud800"', b","])
    )
    return text[:at] + token + text[at:]


@st.composite
def mutated_bodies(draw: Any) -> tuple[str, Any]:
    path, body = draw(st.sampled_from(_valid_bodies()))
    body = json.loads(json.dumps(body))  # a private copy to mutate
    data = _Draw(draw)
    for _ in range(draw(st.integers(1, 3))):
        body = _mutate(data, body)
    if draw(st.integers(0, 4)) == 0:
        return path, _corrupt_text(data, json.dumps(body).encode())
    return path, body


class _Draw:
    """Adapts a composite's `draw` to the `data.draw` the helpers take."""

    def __init__(self, draw: Any) -> None:
        self.draw = draw


def fuzz(http: httpx.Client, cases: Any, max_examples: int, derandomize: bool) -> None:
    health = hypothesis.HealthCheck
    settings = hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=derandomize,
        suppress_health_check=[health.too_slow, health.filter_too_much, health.data_too_large],
    )

    @settings
    @hypothesis.given(cases)
    def one(case: tuple[str, Any]) -> None:
        path, body = case
        post(http, path, b"" if body is None or _not_set(body) else body)

    one()


def _not_set(body: Any) -> bool:
    return type(body).__name__ == "NotSet"


def _strategies(base_url: str) -> list[Any]:
    modes = schemathesis.GenerationMode
    return [
        *(schema_cases(base_url, p, m) for p in (COMPLETIONS, CHAT) for m in modes),
        mutated_bodies(),
        mutated_bodies(),
    ]


def test_openapi_documents_the_request_bodies(http):
    doc = http.get("/openapi.json").json()
    for path, name in ((COMPLETIONS, "CompletionRequest"), (CHAT, "ChatCompletionRequest")):
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"]["$ref"].endswith(name)
        assert "messages" in doc["components"]["schemas"][name]["properties"] or path != CHAT


def test_fuzz_from_schema_and_mutations(http, base_url, cluster, baseline):
    for cases in _strategies(base_url):
        fuzz(http, cases, FUZZ_EXAMPLES, derandomize=True)
    assert_serves_and_clean(http, cluster, baseline)


@pytest.mark.slow
def test_fuzz_long_run(http, base_url, cluster, baseline):
    for cases in _strategies(base_url):
        fuzz(http, cases, SLOW_FUZZ_EXAMPLES, derandomize=False)
    assert_serves_and_clean(http, cluster, baseline)


# ---- explicit cases --------------------------------------------------------------------------
def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "x", "max_tokens": 2, **fields}


def chat(content: Any = "hi", **fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}]
    return {"model": MODEL, "messages": messages, "max_completion_tokens": 2, **fields}


def image_chat(url: str) -> dict[str, Any]:
    return chat([{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": url}}])


def expect_error(response: httpx.Response, status: int, needle: str) -> None:
    assert response.status_code == status, response.text[:1000]
    message = response.json()["error"]["message"]
    assert needle.lower() in message.lower(), message


def _integer_fields(http: httpx.Client) -> list[tuple[str, str]]:
    """(path, field) for every integer-valued field of both request bodies."""
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    found = []
    for path, name in ((COMPLETIONS, "CompletionRequest"), (CHAT, "ChatCompletionRequest")):
        for field, spec in schemas[name]["properties"].items():
            types = {spec.get("type")} | {s.get("type") for s in spec.get("anyOf", [])}
            if "integer" in types:
                found.append((path, field))
    return found


@pytest.mark.parametrize("value", [10**30, -(10**30), 2**63, 2**64 + 1])
def test_integer_overflow_in_every_integer_field(http, value):
    fields = _integer_fields(http)
    assert {"max_tokens", "seed", "top_k", "min_tokens", "logprobs"} <= {f for _, f in fields}
    for path, field in fields:
        body = completion() if path == COMPLETIONS else chat(max_completion_tokens=None)
        response = post(http, path, {**body, field: value})
        expect_error(response, 400, "max_tokens" if field == "max_tokens" and value > 0 else "")
    for prompt in ([value], [[1, 2], [value]]):  # token ids
        expect_error(post(http, COMPLETIONS, completion(prompt=prompt)), 400, "token ids")
    # A stop token id that no token has never matches: accepted.
    response = post(http, COMPLETIONS, completion(stop_token_ids=[abs(value)]))
    assert response.status_code == 200


def test_seed_range(http):
    for seed in (-1, 2**63):
        expect_error(post(http, COMPLETIONS, completion(seed=seed)), 400, "seed")
    assert post(http, COMPLETIONS, completion(seed=2**63 - 1, temperature=1.0)).status_code == 200


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"model": "tiny-llava", "prompt": "x", "top_p": Infinity}', "Infinity"),
        (b'{"model": "tiny-llava", "prompt": "x", "temperature": -Infinity}', "Infinity"),
        (b'{"model": "tiny-llava", "prompt": "x", "presence_penalty": NaN}', "NaN"),
        (b'{"model": "tiny-llava", "prompt": "x", "temperature": 1e999}', "temperature"),
        (b'{"model": "tiny-llava", "prompt": "x", "top_p": -1e999}', "top_p"),
        (b'{"model": "tiny-llava", "prompt": "x", "max_tokens": 1e999}', "max_tokens"),
        (b'{"model": "tiny-llava", "prompt": "x", "max_tokens": 2.5}', "max_tokens"),
        (b'{"model": "tiny-llava", "prompt": "x", "temperature": -0.5}', "temperature"),
        (b'{"model": "tiny-llava", "prompt": "x", "top_k": -2}', "top_k"),
        (b'{"model": "tiny-llava", "prompt": "x", "min_tokens": -1}', "min_tokens"),
        (b'{"model": "tiny-llava", "prompt": "x", "max_tokens": -1}', "max_tokens"),
        (b'{"model": "tiny-llava", "prompt": "x", "logprobs": -1}', "logprobs"),
        (b'{"model": "tiny-llava", "prompt": "x", "stop_token_ids": [-1]}', "stop_token_ids"),
        (b'{"model": "tiny-llava", "prompt": "x", "max_tokens": 4, "min_tokens": 5}', "min_tokens"),
        (b'{"model": "tiny-llava", "prompt": "x", "logit_bias": {"5": NaN}}', "NaN"),
    ],
)
def test_bad_numbers(http, raw, needle):
    expect_error(post(http, COMPLETIONS, raw), 400, needle)


def test_extreme_but_valid_sampling_values(http):
    for fields in (
        {"temperature": 100, "top_p": 1e-300, "top_k": 1_000_000},
        {"temperature": 1e-300, "top_k": -1},
        {"temperature": -0.0, "min_tokens": 2, "max_tokens": 2},
    ):
        assert post(http, COMPLETIONS, completion(**fields)).status_code == 200, fields


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"model": "tiny-llava", "prompt": "\xc3\x28 bad utf-8"}', "JSON"),
        (b'{"model": "tiny-llava", "prompt": "lone \\ud800 surrogate"}', "Unicode"),
        (b'{"model": "tiny-llava", "prompt": ["ok", "\\udfff"]}', "Unicode"),
        (b'{"model": "tiny-llava", "prompt": "x", "stop": ["\\ud800"]}', "Unicode"),
        (b"", "JSON"),
        (b"null", "JSON object"),
        (b'"a string"', "JSON object"),
        (b"model=tiny-llava&prompt=x", "JSON"),
        (b'{"model": "tiny-llava", "prompt": "x"', "JSON"),
        (b'{"model": "tiny-llava", "prompt": "x"} trailing', "JSON"),
    ],
)
def test_bad_text(http, raw, needle):
    expect_error(post(http, COMPLETIONS, raw), 400, needle)


def test_lone_surrogate_in_chat_is_refused_and_pairs_are_text(http):
    raw = b'{"model": "tiny-llava", "messages": [{"role": "user", "content": "\\udc00"}]}'
    expect_error(post(http, CHAT, raw), 400, "Unicode")
    pair = b'{"model": "tiny-llava", "prompt": "\\ud83d\\ude00", "max_tokens": 2}'
    assert post(http, COMPLETIONS, pair).status_code == 200


def _nested(depth: int, leaf: bytes = b"1") -> bytes:
    return b"[" * depth + leaf + b"]" * depth


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "tiny-llava", "prompt": ' + _nested(200_000) + b"}",
        b'{"model": "tiny-llava", "prompt": "x", "user": '
        + b'{"a":' * 50_000
        + b"1"
        + b"}" * 50_000
        + b"}",
        b'{"model": "tiny-llava", "prompt": "x", "stop": ' + _nested(900, b'"s"') + b"}",
        b'{"model": "tiny-llava", "messages": [{"role": "user", "content": '
        + _nested(900)
        + b"}]}",
    ],
    ids=["prompt-200k", "unknown-dict-50k", "stop-900", "content-900"],
)
def test_deeply_nested_json(http, raw):
    path = CHAT if b"messages" in raw else COMPLETIONS
    assert post(http, path, raw).status_code == 400


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (
            {**chat(), "messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "tool_calls",
        ),
        ({**chat(), "messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        (
            {**chat(), "messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]},
            "tool_call_id",
        ),
        (chat([{"type": "audio", "audio": "x"}]), "type"),
        (chat([{"text": "no type"}]), "type"),
        (chat([{"type": "text", "text": 5}]), "text"),
        (chat([{"type": "image_url", "image_url": "data:image/png;base64,AAAA"}]), "image_url"),
        (chat([{"type": "image_url", "image_url": {"url": ""}}]), "url"),
        (chat([None]), "content"),
        (chat({"type": "text", "text": "a dict, not a list"}), "content"),
        (chat(5), "content"),
        ({**chat(), "messages": "hello"}, "messages"),
        ({**chat(), "messages": [None]}, "messages"),
        ({**chat(), "messages": [[]]}, "messages"),
        ({**chat(), "messages": []}, "messages"),
        ({**chat(), "messages": [{"content": "no role"}]}, "role"),
        ({**chat(), "messages": [{"role": 5, "content": "x"}]}, "role"),
        ({**chat(), "messages": [{"role": "user", "content": "x"}] * 1025}, "messages"),
    ],
)
def test_bad_chat_structure(http, body, needle):
    expect_error(post(http, CHAT, body), 400, needle)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (chat(stream=True, stream_options={"include_usage": True, "extra": 1}), "extra"),
        (chat([{"type": "text", "text": "x", "bold": True}]), "bold"),
        (completion(frobnicate={"deep": [1, 2]}), "frobnicate"),
    ],
)
def test_unknown_fields_are_accepted_and_logged(http, caplog, body, field):
    """As vLLM: a field no model declares, at any depth, is ignored, and the gateway's
    warning for the request names it."""
    caplog.set_level(logging.WARNING, logger="pdcluster.cluster.api.serving")
    response = post(http, COMPLETIONS if "prompt" in body else CHAT, body)
    assert response.status_code == 200, response.text[:1000]
    assert any(
        "ignored fields" in r.getMessage() and field in r.getMessage() for r in caplog.records
    )


def test_a_known_field_with_an_unknown_value_stays_a_400(http):
    """A known field whose value we cannot honour stays a 400 naming it."""
    expect_error(post(http, CHAT, chat(modalities=["audio"])), 400, "modalities")


@pytest.mark.parametrize("role", ["function", "", "USER", "robot"])
def test_unknown_roles(http, role):
    body = {**chat(), "messages": [{"role": role, "content": "x"}]}
    expect_error(post(http, CHAT, body), 400, "role")


@pytest.mark.parametrize(
    ("stop", "needle"),
    [
        ("x" * 100_000, "stop"),
        ([f"s{i}" for i in range(1000)], "stop"),
        ([""], "stop"),
        ([1, 2], "stop"),
        (["ok", None], "stop"),
    ],
    ids=["100k-chars", "1000-strings", "empty", "ints", "null"],
)
def test_bad_stop(http, stop, needle):
    expect_error(post(http, COMPLETIONS, completion(stop=stop)), 400, needle)
    expect_error(post(http, CHAT, chat(stop=stop)), 400, needle)


def test_longest_allowed_stop_strings(http):
    stop = [chr(0x4E00 + i) * 256 for i in range(8)]
    assert post(http, COMPLETIONS, completion(stop=stop, max_tokens=4)).status_code == 200


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [([], "empty"), ([[]], "empty"), ([""], "empty"), (["a", ""], "empty"), ([-1], "token ids")],
)
def test_bad_prompts(http, prompt, needle):
    expect_error(post(http, COMPLETIONS, completion(prompt=prompt)), 400, needle)


def test_placeholder_text_without_images(http):
    expect_error(post(http, COMPLETIONS, completion(prompt="<image> hi")), 400, "image")
    url = data_url(random_image(1))
    body = chat(
        [
            {"type": "text", "text": "<image><image>"},
            {"type": "image_url", "image_url": {"url": url}},
        ]
    )
    expect_error(post(http, CHAT, body), 400, "image")


def test_unknown_paths_and_methods_are_openai_shaped(http):
    response = http.get(COMPLETIONS)
    expect_error(response, 405, "method")
    check(response)
    response = http.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
    expect_error(response, 404, "not found")
    check(response)


def test_chunked_body_over_the_limit(cluster):
    app = create_app(cluster, GatewaySettings(max_body_bytes=4096), MODEL, cluster.max_model_len)
    prefix = b'{"model": "tiny-llava", "prompt": "'

    def chunks():  # chunked transfer: no Content-Length for the middleware to check
        yield prefix
        for _ in range(64):
            yield b"y" * 1024
        yield b'"}'

    with running(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        response = client.post(COMPLETIONS, content=chunks())
        expect_error(response, 413, "exceeds")
        small = client.post(COMPLETIONS, json=completion())
        assert small.status_code == 200


# ---- images ----------------------------------------------------------------------------------
def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def as_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels over a few bytes of data."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        crc = zlib.crc32(kind + payload) & 0xFFFFFFFF
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\x00" * 1024)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


def gif_declaring(width: int, height: int) -> bytes:
    screen = struct.pack("<HHBBB", width, height, 0, 0, 0)
    frame = b"," + struct.pack("<HHHH", 0, 0, width, height) + b"\x00\x02\x02\x44\x01\x00"
    return b"GIF89a" + screen + frame + b";"


def _bad_images() -> list[tuple[str, str, str]]:
    png = encode(random_image(3, (32, 32)))
    return [
        ("bomb-header-50k", as_url(png_declaring(50_000, 50_000)), "pixels"),
        ("gif-65535", as_url(gif_declaring(65_535, 65_535), "image/gif"), "pixels"),
        ("zero-size", as_url(png_declaring(0, 10)), "image"),
        ("strip-1x4000", as_url(encode(Image.new("RGB", (4000, 1)))), "aspect ratio"),
        ("truncated-png", as_url(png[: len(png) // 2]), "not a valid image"),
        ("png-header-only", as_url(png[:33]), "not a valid image"),
        ("random-bytes", as_url(bytes(range(256)) * 8), "not a valid image"),
        ("pdf", as_url(b"%PDF-1.4\n1 0 obj\n<<>>\nendobj\n", "image/png"), "not a valid image"),
        ("eps", as_url(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 1 1\n"), "not a valid"),
        ("svg", as_url(b'<svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml"), "valid"),
        ("text-mime", as_url(png, "text/plain"), "image/*"),
        ("no-mime", as_url(png, ""), "image/*"),
        ("not-base64-flag", "data:image/png," + base64.b64encode(png).decode(), "base64"),
        ("empty-data", "data:image/png;base64,", "no data"),
        ("bad-padding", "data:image/png;base64,abc", "base64"),
        ("not-a-data-url", "data:image/png", "malformed"),
        ("surrogate", "data:image/png;base64,\udc00", "Unicode"),
        ("ftp", "ftp://127.0.0.1/x.png", "allow-listed"),
        ("loopback", "http://127.0.0.1:1/x.png", "allow-listed"),
    ]


@pytest.mark.parametrize(
    ("url", "needle"), [c[1:] for c in _bad_images()], ids=[c[0] for c in _bad_images()]
)
def test_bad_images(http, url, needle):
    expect_error(post(http, CHAT, image_chat(url)), 400, needle)


@pytest.mark.parametrize(
    "url",
    [
        as_url(encode(random_image(4).convert("RGB"), "JPEG"), "image/png"),  # mislabelled
        as_url(encode(Image.new("L", (4096, 4096))), "image/png"),  # the largest allowed
        as_url(encode(Image.new("RGBA", (1, 1)))),
        as_url(encode(Image.new("P", (200, 1)), "GIF"), "image/gif"),  # at the ratio limit
        as_url(encode(Image.new("F", (16, 16)), "TIFF"), "image/tiff"),
    ],
    ids=["jpeg-as-png", "4096x4096", "1x1-rgba", "gif-200x1", "tiff-float"],
)
def test_odd_but_valid_images(http, url):
    response = post(http, CHAT, image_chat(url))
    assert response.status_code == 200


def test_still_serving_and_nothing_leaked(http, cluster, baseline):
    assert_serves_and_clean(http, cluster, baseline)
