"""Tool calling over a real stack with the official openai client: the cases of vLLM's tool-use tests
(tests/tool_use: tool calls and their results, parallel calls, tool_choice required and named; and
test_completion_with_function_calling.py), rewritten. The model is the tiny random one, so that what it says
is noise: the grammar alone makes every call parse and follow its tool's schema, at any temperature."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
import requests

from tests.support.api_cluster import cluster_fixture
from tests.support.cluster import MODEL_NAME

cluster = cluster_fixture("tiny_model_path")

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12, "description": "the city, e.g. Dallas"},
        "state": {"type": "string", "enum": ["TX", "FL", "CA"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "state", "unit"],
    "additionalProperties": False,
}
FORECAST_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "description": "Get the current weather in a given location",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_forecast", "description": "The forecast", "parameters": FORECAST_SCHEMA},
    },
]
SCHEMAS = {"get_current_weather": WEATHER_SCHEMA, "get_forecast": FORECAST_SCHEMA}
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are a helpful assistant with access to tools."},
    {"role": "user", "content": "What is the weather in Dallas, Texas in Fahrenheit?"},
]


def ask(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("model", MODEL_NAME)
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("tools", TOOLS)
    kwargs.setdefault("max_completion_tokens", 200)
    return client.chat.completions.create(**kwargs)


def assert_valid_calls(calls: Any) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[dict[str, str]], list[str | None]]:
    """A stream's content, its calls as the deltas build them, and its finish reasons."""
    content, calls, finishes, roles = "", dict[int, dict[str, str]](), [], 0
    for chunk in ask(client, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            roles += delta.role == "assistant"
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                if piece.index not in calls:  # the first delta of a call names it (vLLM's check)
                    assert piece.id and piece.function and piece.function.name
                    calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
                else:
                    assert piece.id is None and (piece.function is None or piece.function.name is None)
                calls[piece.index]["arguments"] += (piece.function.arguments or "") if piece.function else ""
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert roles == 1
    return content, [calls[i] for i in sorted(calls)], finishes


@pytest.mark.parametrize("seed", range(6))
def test_required_calls_follow_their_schemas_whatever_the_sampling(client: openai.OpenAI, seed: int) -> None:
    """vLLM's tool_choice=required cases, at a temperature where a model that is not held would babble."""
    choice = ask(
        client, tool_choice="required", parallel_tool_calls=False, temperature=1.5, seed=seed
    ).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1  # parallel_tool_calls false: exactly one
    assert_valid_calls(choice.message.tool_calls)


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_forecast"}}
    for seed in range(3):
        choice = ask(
            client, tool_choice=named, temperature=1.0, seed=seed, parallel_tool_calls=False
        ).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == ["get_forecast"]
        assert_valid_calls(choice.message.tool_calls)


def test_parallel_calls_are_each_valid(client: openai.OpenAI) -> None:
    """vLLM's parallel tool calls: every call is whole and valid (how many is the model's choice)."""
    choice = ask(client, tool_choice="required", temperature=0, max_completion_tokens=400).choices[0]
    calls = choice.message.tool_calls
    if choice.finish_reason == "length":  # the model went on calling: each call but the cut one is whole
        calls = calls[:-1]
    else:
        assert choice.finish_reason == "tool_calls"
    assert_valid_calls(calls)


def test_a_streamed_call_is_the_whole_call_piece_by_piece(client: openai.OpenAI) -> None:
    """vLLM's streaming tool-call case: the id and name come first, the arguments concatenate to the
    non-streamed ones, and the stream ends with finish_reason tool_calls."""
    kwargs: dict[str, Any] = {"tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}
    whole = ask(client, **kwargs).choices[0]
    content, calls, finishes = streamed(client, **kwargs)
    assert content == "" and finishes == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls
    ]


def test_a_streamed_call_resumes_where_its_client_dropped(cluster: Any, client: openai.OpenAI) -> None:
    """A stream of calls is resumable like any: the rest of it after its last event id completes it."""
    body = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_completion_tokens": 200,
        "stream": True,
    }
    url = f"{cluster.base_url}/v1/chat/completions"

    def chunks(response: requests.Response, limit: int | None = None) -> tuple[list[Any], str | None]:
        out, last = [], None
        for line in response.iter_lines():
            if line.startswith(b"id: "):
                last = line[len(b"id: ") :].decode()
            elif line.startswith(b"data: {"):
                out.append(json.loads(line[len(b"data: ") :]))
                if limit is not None and len(out) >= limit:
                    break
        return out, last

    with requests.post(url, json=body, stream=True, timeout=60) as first:
        head, last = chunks(first, limit=4)
    with requests.post(url, json=body, headers={"Last-Event-ID": str(last)}, stream=True, timeout=60) as rest:
        tail, _ = chunks(rest)
    arguments = "".join(
        piece["function"].get("arguments") or ""
        for chunk in head + tail
        for choice in chunk["choices"]
        for piece in choice["delta"].get("tool_calls", [])
    )
    whole = ask(client, tool_choice="required", parallel_tool_calls=False, temperature=0).choices[0]
    assert arguments == whole.message.tool_calls[0].function.arguments


def test_with_auto_the_model_may_answer_in_text_and_any_call_it_makes_is_valid(client: openai.OpenAI) -> None:
    for seed in range(4):
        choice = ask(
            client, tool_choice="auto", temperature=1.0, seed=seed, max_completion_tokens=60
        ).choices[0]
        if choice.message.tool_calls:
            assert_valid_calls(choice.message.tool_calls[: -1 if choice.finish_reason == "length" else None])
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content is not None


def test_a_call_and_its_result_lead_to_a_text_answer(client: openai.OpenAI) -> None:
    """vLLM's tool call with results: the conversation goes on from the call and the tool's answer."""
    arguments = json.dumps({"city": "Dallas", "state": "TX", "unit": "fahrenheit"})
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_weather_1",
                    "type": "function",
                    "function": {"name": "get_current_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_weather_1", "content": "98 degrees and sunny"},
    ]
    choice = ask(client, messages=messages, tool_choice="none", max_completion_tokens=16).choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = ask(client, messages=messages, tool_choice="none", max_completion_tokens=1).usage
    shorter = ask(client, messages=messages[:2], tool_choice="none", max_completion_tokens=1).usage
    assert usage.prompt_tokens > shorter.prompt_tokens  # the call and its result are in the prompt


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "tools": []}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
        ),
    ],
)
def test_a_bad_tool_request_is_a_400_with_its_parameter(
    client: openai.OpenAI, kwargs: Any, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        ask(client, **kwargs)
    assert raised.value.status_code == 400
    body: Any = raised.value.body
    assert body["param"] == param and body["code"] == "invalid_request"
