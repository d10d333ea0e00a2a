"""`/v1/responses` with the unmodified openai client on a disaggregated (1P1D) cluster of a
tiny model whose template renders tools: the same output as chat completions, whole and
streamed, instructions, max_output_tokens, function calls, structured text, bad input."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from pdcluster.cluster.replicas import gateway_app
from tests.cluster_utils import assert_clean, live_object_ids, random_image, start
from tests.gateway_utils import data_url, running
from tests.test_structured_cluster import WEATHER
from tests.test_structured_output import PERSON

openai = pytest.importorskip("openai")

MODEL = "tiny"
FUZZ_EXAMPLES = 60  # per generation mode
GREEDY = {"temperature": 0}
FUNCTION = {"type": "function", **WEATHER["function"]}  # the Responses API's flat shape
PERSON_TEXT = {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}
STREAM_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def cluster(ray_session, tools_model_dir):
    gateway = {"served_model_name": MODEL, "enable_auto_tool_choice": True,
               "tool_call_parser": "hermes"}  # fmt: skip
    with start(tools_model_dir, prefill=1, decode=1, gateway=gateway) as c:
        yield c


def chat(client, messages, max_tokens, **fields):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, **GREEDY, **fields
    )


def test_output_text_and_usage_equal_chat_completions(client, clean):
    user = "Tell me about the sea."
    expected = chat(client, [{"role": "user", "content": user}], 12)
    for given in (user, [{"role": "user", "content": user}],
                  [{"type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": user}]}]):  # fmt: skip
        out = client.responses.create(model=MODEL, input=given, max_output_tokens=12, **GREEDY)
        assert out.object == "response" and out.id.startswith("resp_")
        [message] = out.output
        assert message.type == "message" and message.role == "assistant"
        assert out.output_text == expected.choices[0].message.content
        assert out.usage.input_tokens == expected.usage.prompt_tokens
        assert out.usage.output_tokens == expected.usage.completion_tokens
        assert out.usage.total_tokens == expected.usage.total_tokens


def test_instructions_and_earlier_turns_render_as_chat_messages(client, clean):
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a colour."},
    ]
    expected = chat(client, [{"role": "system", "content": "Answer briefly."}, *turns], 10)
    echoed = {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": turns[1]["content"],
                           "annotations": []}]}  # fmt: skip
    developer = {"role": "developer", "content": "Answer briefly."}
    for extra, given in (
        ({"instructions": "Answer briefly."}, turns),
        ({"instructions": "Answer briefly."}, [turns[0], echoed, turns[2]]),
        ({}, [developer, *turns]),
    ):
        out = client.responses.create(
            model=MODEL, input=given, max_output_tokens=10, **GREEDY, **extra
        )
        assert out.output_text == expected.choices[0].message.content
        assert out.usage.input_tokens == expected.usage.prompt_tokens
    assert out.instructions is None


def test_running_out_of_max_output_tokens_is_incomplete(client, clean):
    expected = chat(client, [{"role": "user", "content": "Count"}], 3)
    assert expected.choices[0].finish_reason == "length"
    out = client.responses.create(model=MODEL, input="Count", max_output_tokens=3, **GREEDY)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].status == "incomplete" and out.usage.output_tokens == 3
    assert out.output_text == expected.choices[0].message.content
    assert out.max_output_tokens == 3 and out.temperature == 0


def test_a_streamed_response_sends_the_numbered_events(client, clean):
    whole = client.responses.create(model=MODEL, input="Stream", max_output_tokens=8, **GREEDY)
    events = list(
        client.responses.create(
            model=MODEL, input="Stream", max_output_tokens=8, stream=True, **GREEDY
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert list(dict.fromkeys(kinds)) == [*STREAM_EVENTS, "response.incomplete"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == text
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.id == events[0].response.id


def test_a_client_that_leaves_mid_stream_frees_every_block(client, clean):
    stream = client.responses.create(
        model=MODEL, input="Go on and on.", max_output_tokens=400, stream=True, **GREEDY
    )
    kinds = []
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            break
    stream.close()  # the clean fixture then finds every instance idle, all blocks free
    assert kinds == STREAM_EVENTS[:5]


def test_the_stream_helper_returns_schema_valid_json(client, clean):
    with client.responses.stream(
        model=MODEL, input="A person, as JSON.", max_output_tokens=120, text=PERSON_TEXT, **GREEDY
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas)
    jsonschema.validate(json.loads(final.output_text), PERSON)
    whole = client.responses.create(
        model=MODEL, input="A person, as JSON.", max_output_tokens=120, text=PERSON_TEXT, **GREEDY
    )
    assert whole.output_text == final.output_text
    assert whole.text.format.type == "json_schema"
    anything = client.responses.create(
        model=MODEL, input="JSON please", max_output_tokens=8, text={"format": {"type": "json_object"}},
        **GREEDY,
    )  # fmt: skip
    assert anything.output_text.startswith("{")  # any JSON object: this one runs out of tokens


def function_calls(out):
    calls = [item for item in out.output if item.type == "function_call"]
    for call in calls:
        assert call.call_id.startswith("call_") and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    return calls


def test_a_function_call_round_trip(client, clean):
    question = {"role": "user", "content": "What is the weather in Oslo?"}
    out = client.responses.create(
        model=MODEL, input=[question], tools=[FUNCTION], tool_choice="required",
        max_output_tokens=64, **GREEDY,
    )  # fmt: skip
    [call] = function_calls(out)
    assert out.status == "completed" and out.output == [call]
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "4 degrees"}
    follow_up = [question, call.model_dump(exclude_none=True), answer]
    out = client.responses.create(
        model=MODEL, input=follow_up, tools=[FUNCTION], max_output_tokens=6, **GREEDY
    )
    as_chat = [
        question,
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id,
         "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "4 degrees"},
    ]  # fmt: skip
    expected = chat(client, as_chat, 6, tools=[WEATHER])
    assert out.usage.input_tokens == expected.usage.prompt_tokens
    assert out.output_text == (expected.choices[0].message.content or "")


def test_a_streamed_named_call_arrives_as_one_function_call_item(client, clean):
    named = {"type": "function", "name": "get_weather"}
    events = list(
        client.responses.create(
            model=MODEL, input="Weather?", tools=[FUNCTION], tool_choice=named,
            max_output_tokens=64, stream=True, **GREEDY,
        )
    )  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [call] = function_calls(events[-1].response)
    assert events[4].arguments == call.arguments
    assert events[-1].response.tool_choice.name == "get_weather"


BAD = [
    ({"input": []}, "input", "must not be empty"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0", "role"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input.0", "type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0", "call_id"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
        "input.0",
        "file_id is not supported",
    ),
    ({"conversation": "conv_1"}, "conversation", "stores no responses"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal"),
    ({"temperature": -1}, "temperature", "greater than or equal"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"background": True}, "background", "stores no responses"),
    ({"truncation": "auto"}, "truncation", "disabled"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    (
        {"tools": [FUNCTION], "tool_choice": {"type": "function", "name": "nope"}},
        "tool_choice",
        "not in tools",
    ),
    ({"tools": [{"type": "function", "name": "a b"}]}, "tools.0.name", "pattern"),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
        "text.format",
        "invalid JSON schema",
    ),
]


@pytest.mark.parametrize(("fields", "param", "needle"), BAD)
def test_bad_input_is_a_400_naming_the_field(base_url, fields, param, needle):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, **fields}
    response = httpx.post(f"{base_url}/v1/responses", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param) and needle in error["message"], error


def test_stateless_fields_are_accepted_and_nothing_is_stored(base_url, clean):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "store": True, "user": "u",
            "metadata": {"team": "a"}, "some_vendor_field": 1}  # fmt: skip
    response = httpx.post(f"{base_url}/v1/responses", json=body, timeout=30)
    assert response.status_code == 200, response.text
    created = response.json()
    assert created["metadata"] == {"team": "a"} and created["store"] is False
    fetched = httpx.get(f"{base_url}/v1/responses/{created['id']}", timeout=30)
    assert fetched.status_code == 404 and "not stored" in fetched.json()["error"]["message"]
    other = httpx.post(f"{base_url}/v1/responses", json={**body, "model": "other"}, timeout=30)
    assert other.status_code == 404
    schema = httpx.get(f"{base_url}/openapi.json", timeout=30).json()
    assert "ResponsesRequest" in schema["components"]["schemas"]
    assert "/v1/responses" in schema["paths"]


def test_an_input_image_is_seen_as_in_chat(ray_session, model_dir):
    """tiny-llava (a multimodal preset): an `input_image` part is chat's `image_url` part."""
    url = data_url(random_image(3))
    with start(model_dir, mixed=1, gateway={"served_model_name": MODEL}) as cluster, running(
        gateway_app(cluster)
    ) as base:  # fmt: skip
        baseline = live_object_ids()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        parts = [{"type": "text", "text": "What is this?"},
                 {"type": "image_url", "image_url": {"url": url}}]  # fmt: skip
        expected = chat(client, [{"role": "user", "content": parts}], 8)
        parts = [{"type": "input_text", "text": "What is this?"},
                 {"type": "input_image", "image_url": url}]  # fmt: skip
        out = client.responses.create(
            model=MODEL, input=[{"role": "user", "content": parts}], max_output_tokens=8, **GREEDY
        )
        assert out.output_text == expected.choices[0].message.content
        assert out.usage.input_tokens == expected.usage.prompt_tokens
        assert_clean(cluster, baseline)


def test_generated_bodies_never_fail_the_server(base_url, clean):
    """Bodies from the served OpenAPI document, valid and invalid per its schema: no 5xx,
    every 4xx OpenAI-shaped (the fuzz suite's property)."""
    fuzzing = pytest.importorskip("tests.test_gateway_fuzz")  # needs schemathesis

    def tame(case: tuple[str, Any]) -> tuple[str, Any]:
        path, body = case
        if isinstance(body, dict) and type(body.get("max_output_tokens")) is int:
            body["max_output_tokens"] = min(max(body["max_output_tokens"], 1), 3)
        elif isinstance(body, dict):
            body["max_output_tokens"] = 3
        return path, body

    with httpx.Client(base_url=base_url, timeout=120) as http:
        for mode in fuzzing.schemathesis.GenerationMode:
            cases = fuzzing.schema_cases(base_url, "/v1/responses", mode).map(tame)
            fuzzing.fuzz(http, cases, FUZZ_EXAMPLES, derandomize=True)
