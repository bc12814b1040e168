"""The Responses API over a real stack with the official openai client: the cases of vLLM's Responses tests
(tests/entrypoints/openai: simple input, instructions, messages as input, structured output, streaming and its
events, store and retrieve, background and cancel, stateful turns, function calling), rewritten. The model is
the tiny random one: its words are noise, so the cases check the shapes, the grammar and the store."""

from __future__ import annotations

import json
import time
from typing import Any

import jsonschema
import openai
import pytest

from tests.support.api_cluster import cluster_fixture
from tests.support.cluster import MODEL_NAME

cluster = cluster_fixture("tiny_model_path")

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": WEATHER_SCHEMA,
        "strict": True,
    }
]


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("model", MODEL_NAME)
    kwargs.setdefault("max_output_tokens", 24)
    kwargs.setdefault("temperature", 0)
    return client.responses.create(**kwargs)


def test_a_simple_input_and_instructions(client: openai.OpenAI) -> None:
    response = create(client, input="What is 13 * 24?", instructions="Answer with a number.")
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    assert response.output_text and response.output[0].type == "message"
    assert response.instructions == "Answer with a number."
    assert response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_messages_as_input_and_greedy_repeats(client: openai.OpenAI) -> None:
    items: Any = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a joke."}]},
    ]
    first, second = create(client, input=items), create(client, input=items)
    assert first.output_text == second.output_text
    listed = client.responses.input_items.list(first.id, order="asc")
    assert [item.role for item in listed.data] == ["system", "user", "assistant", "user"]


def test_max_output_tokens_ends_it_incomplete(client: openai.OpenAI) -> None:
    response = create(client, input="Write a long story.", max_output_tokens=5, instructions=None)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5


def test_a_json_schema_format_is_followed(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    text: Any = {"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}}
    response = create(client, input="Make up a person.", text=text, max_output_tokens=80, temperature=1.0)
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), schema)


def test_the_stream_reads_as_the_sdk_expects(client: openai.OpenAI) -> None:
    kinds = []
    with client.responses.stream(model=MODEL_NAME, input="Say hello.", max_output_tokens=16) as stream:
        text, last = "", None
        for event in stream:
            kinds.append(event.type)
            last = event
            if event.type == "response.output_text.delta":
                text += event.delta
    # The SDK's get_final_response() is for a response.completed; a cut answer ends response.incomplete.
    assert last is not None and last.type in ("response.completed", "response.incomplete")
    final = last.response
    assert kinds[0] == "response.created"
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert final.output_text == text
    stored = client.responses.retrieve(final.id)
    assert stored.output_text == text and stored.status == final.status


def test_store_retrieve_delete_and_store_false(client: openai.OpenAI) -> None:
    response = create(client, input="Name a colour.")
    assert client.responses.retrieve(response.id).output_text == response.output_text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(response.id)
    assert gone.value.body["code"] == "response_not_found"  # type: ignore[index]
    unstored = create(client, input="Name a colour.", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_previous_response_id_carries_the_conversation_and_hits_the_prefix_cache(
    client: openai.OpenAI,
) -> None:
    instructions = "You are a careful assistant who answers questions about geography in full sentences."
    first = create(client, input="Which is the largest ocean on Earth?", instructions=instructions)
    second = create(
        client, input="And the smallest?", instructions=instructions, previous_response_id=first.id
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16  # at least a block of the first prompt
    with pytest.raises(openai.NotFoundError) as unknown:
        create(client, input="hi", previous_response_id="resp_nothing")
    assert unknown.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_a_function_call_and_its_output_lead_to_an_answer(client: openai.OpenAI) -> None:
    response = create(
        client,
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and response.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    outputs: Any = [
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"} for call in calls
    ]
    answer = create(client, input=outputs, previous_response_id=response.id, tools=TOOLS, tool_choice="none")
    assert answer.output and all(item.type == "message" for item in answer.output)


def test_a_streamed_function_call_builds_the_same_call(client: openai.OpenAI) -> None:
    kwargs: Any = {
        "model": MODEL_NAME,
        "input": "Weather in Rome?",
        "tools": TOOLS,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False,
        "max_output_tokens": 80,
        "temperature": 0,
    }
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        fragments = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    [call] = [item for item in final.output if item.type == "function_call"]
    [whole_call] = [item for item in whole.output if item.type == "function_call"]
    assert "".join(fragments) == call.arguments == whole_call.arguments


def test_a_background_response_is_polled_to_its_end(client: openai.OpenAI) -> None:
    response = create(client, input="Count to twenty.", background=True, max_output_tokens=40)
    assert response.status == "queued" and response.background
    deadline = time.monotonic() + 60
    while response.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, response
        time.sleep(0.1)
        response = client.responses.retrieve(response.id)
    assert response.status in ("completed", "incomplete") and response.output_text


def test_a_background_response_is_cancelled(client: openai.OpenAI) -> None:
    response = create(client, input="Write a very long essay.", background=True, max_output_tokens=1500)
    cancelled = client.responses.cancel(response.id)
    assert cancelled.status == "cancelled"
    time.sleep(0.5)
    after = client.responses.retrieve(response.id)
    assert after.status == "cancelled"
    assert after.usage is None or after.usage.output_tokens < 1500  # it stopped early


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"background": True, "store": False}, "background"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ],
)
def test_a_bad_request_is_a_400_naming_its_parameter(client: openai.OpenAI, kwargs: Any, param: str) -> None:
    kwargs = {"input": "hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as error:
        create(client, **kwargs)
    assert error.value.body["param"] == param  # type: ignore[index]
