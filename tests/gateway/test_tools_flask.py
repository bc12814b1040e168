"""Tool calling at the gateway: the tools' checks (400s naming the parameter), the prompt and grammar a
request becomes, and the calls read back out of a worker's tokens, whole and streamed, through the Flask test
client over a real Redis."""

from __future__ import annotations

import itertools
import json
from typing import Any

import llguidance
import llguidance.hf
import pytest

from gateway.serving.tools import Tool, grammar, read_calls
from tests.support.gateway_app import (
    CHAT,
    USER,
    assert_openai_error,
    data_of,
    paced_stream,
    queued,
    run,
    sent,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
SECOND = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def tools_body(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, "tools": [WEATHER, TIME], **fields}


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required", "tools": []}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, None),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            None,
        ),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_a_bad_tool_request_is_a_400_naming_the_parameter(client, r, keys, fields, param) -> None:
    before = queued(r, keys)
    response = client.post(CHAT, json=tools_body(**fields))
    error = assert_openai_error(response, 400)
    expected = param or "tools[0].function.parameters"
    assert error["param"] == expected or error["param"].startswith(expected), error
    assert queued(r, keys) == before


@pytest.mark.usefixtures("worker")
def test_tools_reach_the_prompt_and_the_grammar_holds_the_calls(client, r, keys, tok) -> None:
    request = sent(client, r, keys, CHAT, tools_body())
    prompt = tok.decode(request.prompt_token_ids)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and "<tool_call>" in prompt
    structured = request.sampling.structured
    assert structured is not None and structured.kind == "grammar"
    assert "PLAIN" in structured.value and "get_time" in structured.value  # auto: text, or calls of either
    named = sent(
        client, r, keys, CHAT, tools_body(tool_choice={"type": "function", "function": {"name": "get_time"}})
    )
    assert named.sampling.structured is not None and "get_weather" not in named.sampling.structured.value
    none = sent(client, r, keys, CHAT, tools_body(tool_choice="none"))
    assert none.sampling.structured is None and "<tools>" in tok.decode(none.prompt_token_ids)


@pytest.mark.usefixtures("worker")
def test_an_earlier_call_and_its_result_are_shown_to_the_model(client, r, keys, tok) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "what time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
    ]
    request = sent(client, r, keys, CHAT, {"messages": messages, "tools": [TIME]})
    prompt = tok.decode(request.prompt_token_ids)
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in prompt
    assert "<tool_response>\nnoon\n</tool_response>" in prompt
    bad = {**call, "function": {"name": "get_time", "arguments": "{not json"}}
    messages[1]["tool_calls"] = [bad]
    response = client.post(CHAT, json={"messages": messages})
    assert assert_openai_error(response, 400)["param"] == "messages[1].tool_calls[0].function.arguments"


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize("before", ["", "Let me look that up.\n"])
def test_calls_come_back_as_tool_calls_whole_and_streamed(client, r, keys, tok, before: str) -> None:
    ids = tok.encode(before + CALL + "\n" + SECOND)
    whole, _ = run(client, r, keys, CHAT, tools_body(), ids, finish="stop")
    choice = whole.get_json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] == (before.strip() or None)
    calls = message["tool_calls"]
    assert [(c["type"], c["function"]["name"]) for c in calls] == [
        ("function", "get_weather"),
        ("function", "get_time"),
    ]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]

    # Streamed, a token at a time: the calls' deltas as they grow.
    chunks = data_of(paced_stream(client, r, keys, CHAT, tools_body(), ids))
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == before.strip()
    pieces: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for piece in delta.get("tool_calls", []):
            if piece["index"] not in pieces:  # its first delta: the id and name
                assert piece["id"] and piece["function"]["name"], piece
                pieces[piece["index"]] = {"name": piece["function"]["name"], "arguments": ""}
            pieces[piece["index"]]["arguments"] += piece["function"]["arguments"]
    assert [p["name"] for p in pieces.values()] == ["get_weather", "get_time"]
    assert [p["arguments"] for p in pieces.values()] == [c["function"]["arguments"] for c in calls]
    assert len([d for d in deltas if d.get("tool_calls")]) > 2  # the arguments come piece by piece
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert finishes[-1] == "tool_calls" and finishes.count("tool_calls") == 1


@pytest.mark.usefixtures("worker")
def test_plain_text_with_tools_is_content_and_stops_as_text(client, r, keys, tok) -> None:
    ids = tok.encode("It is sunny, and a < b.")
    response, _ = run(client, r, keys, CHAT, tools_body(), ids, finish="stop")
    choice = response.get_json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny, and a < b."}
    assert choice["finish_reason"] == "stop"


def test_each_view_of_a_growing_answer_extends_the_one_before() -> None:
    """The stream's deltas are differences of successive views: none may take back what an earlier one
    showed, at any cut of the text."""
    text = "Sure.\n" + CALL + "\n" + SECOND
    views = [read_calls(text[:n], final=False) for n in range(len(text) + 1)]
    views.append(read_calls(text, final=True))
    for shorter, longer in itertools.pairwise(views):
        assert longer.content.startswith(shorter.content)
        assert len(longer.calls) >= len(shorter.calls)
        for a, b in zip(shorter.calls, longer.calls):
            assert a.name == b.name and b.arguments.startswith(a.arguments)
    final = views[-1]
    assert final.content == "Sure." and final.called
    assert [c.arguments for c in final.calls] == ['{"city": "Paris", "unit": "c"}', "{}"]


@pytest.mark.parametrize(
    ("choice", "parallel", "text", "accepted"),
    [
        ("auto", True, "It is sunny, and a < b.", True),
        ("auto", True, "Let me look.\n" + CALL, True),
        ("auto", True, CALL + "\n" + SECOND, True),
        ("auto", False, CALL + "\n" + SECOND, False),  # one call at most
        ("auto", True, CALL + " and then some text", False),  # nothing after the calls
        ("auto", True, 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"town": "x"}}', False),
        ("auto", True, '<tool_call>\n{"name": "unknown", "arguments": {}}', False),
        ("required", True, "It is sunny.", False),
        ("required", True, SECOND, True),
        ("get_time", True, CALL, False),
        ("get_time", True, SECOND, True),
        (
            "auto",
            True,
            '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}',
            False,
        ),  # layout
    ],
)
def test_the_grammar_holds_the_answer_to_the_format_and_the_schemas(
    tok, choice: str, parallel: bool, text: str, accepted: bool
) -> None:
    tools = [Tool("get_weather", None, WEATHER["function"]["parameters"]), Tool("get_time")]
    ll = llguidance.hf.from_tokenizer(tok.hf, n_vocab=tok.vocab_size, eos_token=tok.hf.eos_token_id)
    matcher = llguidance.LLMatcher(ll, grammar(tools, choice, parallel), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    taken = matcher.consume_tokens(tok.encode(text))
    assert (taken and matcher.is_accepting()) == accepted, matcher.get_error()


@pytest.mark.usefixtures("worker")
def test_tokenize_with_tools_gives_the_prompt_a_chat_request_becomes(client, r, keys) -> None:
    request = sent(client, r, keys, CHAT, tools_body())
    tokens = client.post("/tokenize", json=tools_body()).get_json()["tokens"]
    assert tokens == request.prompt_token_ids
    without = client.post("/tokenize", json={"messages": USER}).get_json()["tokens"]
    assert len(without) < len(tokens)
    named = tools_body(tool_choice={"type": "function", "function": {"name": "nope"}})
    assert assert_openai_error(client.post("/tokenize", json=named), 400)["param"] == "tool_choice"
