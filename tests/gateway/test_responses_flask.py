"""The Responses API at the gateway: a request's input and tools in the prompt, the output items whole and as
typed events, the store (GET, DELETE, input items, previous_response_id, its bound), background responses and
their cancel, and the 400s naming the parameter, through the Flask test client over a real Redis."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from gateway.serving.response_store import ResponseStore, StoredResponse
from tests.support.gateway_app import (
    PacedWorker,
    assert_openai_error,
    data_of,
    paced_stream,
    queued,
    run,
    sent,
    wait_for,
)

RESPONSES = "/v1/responses"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def answered(client, r, keys, tok, body: dict[str, Any], text: str, finish: str = "stop") -> dict[str, Any]:
    response, _ = run(client, r, keys, RESPONSES, body, tok.encode(text), finish=finish)
    assert response.status_code == 200, response.get_data(as_text=True)
    return response.get_json()


def output_text(response: dict[str, Any]) -> str:
    return "".join(
        part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"]
    )


@pytest.mark.usefixtures("worker")
def test_a_response_is_a_chat_turn_and_is_stored(client, r, keys, tok) -> None:
    body = {"input": "What is the capital of France?", "instructions": "Answer in one word."}
    request = sent(client, r, keys, RESPONSES, body)
    prompt = tok.decode(request.prompt_token_ids)
    assert prompt.index("Answer in one word.") < prompt.index("What is the capital of France?")
    assert request.request_id.startswith("resp_")

    response = answered(client, r, keys, tok, body, "Paris.")
    assert response["object"] == "response" and response["status"] == "completed"
    assert output_text(response) == "Paris."
    [item] = response["output"]
    assert (item["type"], item["role"], item["status"]) == ("message", "assistant", "completed")
    usage = response["usage"]
    assert usage["output_tokens"] == len(tok.encode("Paris."))
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert response["instructions"] == "Answer in one word." and response["store"] is True

    fetched = client.get(f"{RESPONSES}/{response['id']}")
    assert fetched.status_code == 200 and fetched.get_json() == response
    items = client.get(f"{RESPONSES}/{response['id']}/input_items").get_json()
    assert items["object"] == "list" and not items["has_more"]
    [given] = items["data"]
    assert given["role"] == "user" and given["content"][0]["text"] == body["input"]
    assert items["first_id"] == items["last_id"] == given["id"]

    deleted = client.delete(f"{RESPONSES}/{response['id']}")
    assert deleted.get_json() == {"id": response["id"], "object": "response", "deleted": True}
    gone = client.get(f"{RESPONSES}/{response['id']}")
    assert assert_openai_error(gone, 404)["code"] == "response_not_found"


@pytest.mark.usefixtures("worker")
def test_store_false_keeps_nothing_and_another_key_sees_nothing(make_app, r, keys, tok) -> None:
    client = make_app(api_keys="one,two").test_client()
    one, two = {"Authorization": "Bearer one"}, {"Authorization": "Bearer two"}
    response, _ = run(client, r, keys, RESPONSES, {"input": "hi", "store": False}, tok.encode("yo"), one)
    unstored = response.get_json()
    assert unstored["store"] is False
    assert client.get(f"{RESPONSES}/{unstored['id']}", headers=one).status_code == 404
    response, _ = run(client, r, keys, RESPONSES, {"input": "hi"}, tok.encode("yo"), one)
    stored = response.get_json()["id"]
    assert client.get(f"{RESPONSES}/{stored}", headers=one).status_code == 200
    assert (
        assert_openai_error(client.get(f"{RESPONSES}/{stored}", headers=two), 404)["param"] == "response_id"
    )
    assert client.delete(f"{RESPONSES}/{stored}", headers=two).status_code == 404


@pytest.mark.usefixtures("worker")
def test_a_long_answer_is_incomplete_at_max_output_tokens(client, r, keys, tok) -> None:
    body = {"input": "count", "max_output_tokens": 3}
    response = answered(client, r, keys, tok, body, " one two", finish="length")
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["max_output_tokens"] == 3


@pytest.mark.usefixtures("worker")
def test_the_stream_is_the_typed_events_the_sdk_reads(client, r, keys, tok) -> None:
    blocks = paced_stream(
        client, r, keys, RESPONSES, {"input": "capital?"}, tok.encode("Paris is the capital.")
    )
    events = data_of(blocks)
    assert [b.split("\n")[0] for b in blocks] == [f"event: {e['type']}" for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-5:] == [
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == "Paris is the capital."
    final = events[-1]["response"]
    assert final["status"] == "completed" and output_text(final) == "Paris is the capital."
    item_ids = {e["item_id"] for e in events if "item_id" in e}
    assert item_ids == {final["output"][0]["id"]}
    assert client.get(f"{RESPONSES}/{final['id']}").get_json() == final


@pytest.mark.usefixtures("worker")
def test_function_calls_are_output_items_whole_and_streamed(client, r, keys, tok) -> None:
    body = {"input": "weather in Paris?", "tools": [WEATHER]}
    request = sent(client, r, keys, RESPONSES, body)
    prompt = tok.decode(request.prompt_token_ids)
    assert '"name": "get_weather"' in prompt and request.sampling.structured is not None

    response = answered(client, r, keys, tok, body, "Looking.\n" + CALL)
    message, call = response["output"]
    assert message["type"] == "message"
    assert output_text(response) == "Looking."
    assert (call["type"], call["name"], call["status"]) == ("function_call", "get_weather", "completed")
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["call_id"].startswith("call_")
    assert response["tools"] == [WEATHER] and response["tool_choice"] == "auto"

    events = data_of(paced_stream(client, r, keys, RESPONSES, body, tok.encode(CALL)))
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["item"]["type"] for e in added] == ["function_call"]
    assert added[0]["item"]["name"] == "get_weather" and added[0]["item"]["arguments"] == ""
    fragments = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert len(fragments) > 1 and "".join(fragments) == done["arguments"]
    assert json.loads(done["arguments"]) == {"city": "Paris"}
    final = events[-1]["response"]
    assert final["output"][0]["arguments"] == done["arguments"]
    assert final["output"][0]["id"] == added[0]["item"]["id"] == done["item_id"]


@pytest.mark.usefixtures("worker")
def test_previous_response_id_continues_the_conversation(client, r, keys, tok) -> None:
    first = answered(client, r, keys, tok, {"input": "weather in Paris?", "tools": [WEATHER]}, CALL)
    [call] = first["output"]
    follow = {
        "previous_response_id": first["id"],
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny, 21 C"}],
        "tools": [WEATHER],
    }
    request = sent(client, r, keys, RESPONSES, follow)
    prompt = tok.decode(request.prompt_token_ids)
    assert prompt.index("weather in Paris?") < prompt.index('"arguments": {"city": "Paris"}')
    assert prompt.index('"arguments": {"city": "Paris"}') < prompt.index("<tool_response>\nsunny, 21 C")

    second = answered(client, r, keys, tok, follow, "It is sunny.")
    assert second["previous_response_id"] == first["id"] and output_text(second) == "It is sunny."
    third = sent(
        client,
        r,
        keys,
        RESPONSES,
        {"previous_response_id": second["id"], "input": "and tomorrow?", "tools": [WEATHER]},
    )
    later = tok.decode(third.prompt_token_ids)
    assert later.index("sunny, 21 C") < later.index("It is sunny.") < later.index("and tomorrow?")
    assert (
        third.prompt_token_ids[: len(request.prompt_token_ids)] == request.prompt_token_ids
    )  # a cached prefix


@pytest.mark.usefixtures("worker")
def test_items_in_the_input_are_the_conversation(client, r, keys, tok) -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "time?"}]},
        {"type": "function_call", "call_id": "call_7", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_7", "output": "noon"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is noon."}]},
        {"role": "user", "content": "thanks"},
    ]
    request = sent(client, r, keys, RESPONSES, {"input": items, "tools": [{**WEATHER, "name": "get_time"}]})
    prompt = tok.decode(request.prompt_token_ids)
    order = [
        "Be brief.",
        "time?",
        '"name": "get_time", "arguments": {}',
        "<tool_response>\nnoon",
        "It is noon.",
        "thanks",
    ]
    positions = [prompt.index(piece) for piece in order]
    assert positions == sorted(positions), prompt


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize(
    ("fields", "param", "status"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", 400),
        ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name", 400),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", 400),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice", 400),
        ({"tool_choice": "required"}, "tool_choice", 400),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", 400),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
            400,
        ),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", 400),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", 400),
        ({"input": []}, "input", 400),
        ({"input": 5}, "input", 400),
        ({"background": True, "store": False}, "background", 400),
        ({"background": True, "stream": True}, "stream", 400),
        ({"previous_response_id": "resp_none"}, "previous_response_id", 404),
        ({"max_output_tokens": 5000}, "max_output_tokens", 400),
        ({"max_output_tokens": 0}, "max_output_tokens", 400),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", 400),
        ({"temperature": -1}, "temperature", 400),
        ({"truncation": "auto"}, "truncation", 400),
        ({"include": ["message.output_text.logprobs"]}, "include", 400),
    ],
)
def test_a_bad_request_is_an_error_naming_the_parameter(client, r, keys, fields, param, status) -> None:
    before = queued(r, keys)
    response = client.post(RESPONSES, json={"input": "hi", **fields})
    error = assert_openai_error(response, status)
    assert error["param"] == param, error
    assert queued(r, keys) == before


@pytest.mark.usefixtures("worker")
def test_a_json_schema_format_is_the_grammar(client, r, keys) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    text = {"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}}
    request = sent(client, r, keys, RESPONSES, {"input": "give a", "text": text})
    structured = request.sampling.structured
    assert structured is not None and structured.kind == "json"
    assert json.loads(structured.value) == schema


@pytest.mark.usefixtures("worker")
def test_a_background_response_is_polled_and_can_be_cancelled(client, r, keys, tok) -> None:
    response, _ = run(
        client, r, keys, RESPONSES, {"input": "hi", "background": True}, tok.encode("hello there")
    )
    queued_response = response.get_json()
    assert queued_response["status"] == "queued" and queued_response["background"] is True

    def status() -> str:
        return client.get(f"{RESPONSES}/{queued_response['id']}").get_json()["status"]

    wait_for(lambda: status() == "incomplete")  # the fake worker ends it with "length"
    done = client.get(f"{RESPONSES}/{queued_response['id']}").get_json()
    assert output_text(done) == "hello there"
    assert assert_openai_error(client.post(f"{RESPONSES}/{done['id']}/cancel"), 400)["param"] == "response_id"

    ids = tok.encode("a long answer that goes on")
    r.delete(keys.requests)
    paced = PacedWorker(r, keys, ids)
    paced.start()
    running = client.post(RESPONSES, json={"input": "hi", "background": True}).get_json()
    wait_for(lambda: paced.requests)
    paced.release(2)

    def partial() -> dict[str, Any]:
        return client.get(f"{RESPONSES}/{running['id']}").get_json()

    # The stored response grows a token at a time: "in_progress" comes with the first of the two.
    wait_for(lambda: output_text(partial()) == tok.decode(ids[:2]))
    assert partial()["status"] == "in_progress"
    cancelled = client.post(f"{RESPONSES}/{running['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.get_json()["status"] == "cancelled"
    assert r.get(keys.abort_flag(running["id"])) == "cancelled"
    paced.release(len(ids))
    time.sleep(0.3)
    assert status_of(client, running["id"]) == "cancelled"
    again = client.post(f"{RESPONSES}/{running['id']}/cancel")
    assert again.status_code == 200 and again.get_json()["status"] == "cancelled"


def status_of(client, response_id: str) -> str:
    return client.get(f"{RESPONSES}/{response_id}").get_json()["status"]


@pytest.mark.usefixtures("worker")
def test_a_background_response_finishes_in_whichever_process_fetches_it(make_app, r, keys, tok) -> None:
    """The process that ran it went before storing its end: a GET in another reads the token record."""
    first, second = make_app().test_client(), make_app().test_client()
    ids = tok.encode("hello there")
    r.delete(keys.requests)
    paced = PacedWorker(r, keys, ids, finish="stop")
    paced.start()
    created = first.post(RESPONSES, json={"input": "hi", "background": True}).get_json()
    wait_for(lambda: paced.requests)
    stored = json.loads(r.get(keys.response(created["id"])))
    paced.release(len(ids))
    wait_for(lambda: status_of(first, created["id"]) == "completed")
    r.set(keys.response(created["id"]), json.dumps(stored))  # as it was before the end was stored
    fetched = second.get(f"{RESPONSES}/{created['id']}").get_json()
    assert fetched["status"] == "completed" and output_text(fetched) == "hello there"


@pytest.mark.usefixtures("worker")
def test_the_store_keeps_at_most_its_bound(make_app, r, keys, tok) -> None:
    client = make_app(response_store_max=2).test_client()
    made = [answered(client, r, keys, tok, {"input": f"hi {i}"}, "yo")["id"] for i in range(3)]
    assert client.get(f"{RESPONSES}/{made[0]}").status_code == 404
    assert all(client.get(f"{RESPONSES}/{rid}").status_code == 200 for rid in made[1:])
    assert r.zcard(keys.responses) == 2
    assert 0 < r.ttl(keys.response(made[2])) <= 30 * 24 * 3600


@pytest.mark.usefixtures("worker")
def test_input_items_are_paged(client, r, keys, tok) -> None:
    items = [{"role": "user", "content": f"message {i}"} for i in range(5)]
    rid = answered(client, r, keys, tok, {"input": items}, "ok")["id"]
    page = client.get(f"{RESPONSES}/{rid}/input_items?limit=2&order=asc").get_json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["message 0", "message 1"] and page["has_more"]
    rest = client.get(f"{RESPONSES}/{rid}/input_items?order=asc&after={page['last_id']}").get_json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["message 2", "message 3", "message 4"]
    newest = client.get(f"{RESPONSES}/{rid}/input_items?limit=1").get_json()
    assert newest["data"][0]["content"][0]["text"] == "message 4"
    bad = client.get(f"{RESPONSES}/{rid}/input_items?limit=0")
    assert assert_openai_error(bad, 400)["param"] == "limit"


def test_a_change_made_meanwhile_is_not_overwritten(r, keys) -> None:
    """A background run's end read the record before a cancel wrote it: its write is retried against the
    cancel and leaves it (a plain read-then-write would store the end over the cancel)."""
    store = ResponseStore(r, keys, ttl_s=60, max_stored=10)
    record = StoredResponse(request_id="cmpl-x", response={"id": "resp_race", "status": "in_progress"})
    store.save(record)
    calls: list[str] = []

    def end(current: StoredResponse) -> StoredResponse | None:
        calls.append(current.status)
        if len(calls) == 1:  # the cancel lands between this read and the write
            store.save(
                StoredResponse(request_id="cmpl-x", response={"id": "resp_race", "status": "cancelled"})
            )
        if current.status == "cancelled":
            return None
        current.response = {**current.response, "status": "completed"}
        return current

    assert store.update("resp_race", "", end).status == "cancelled"
    assert calls == ["in_progress", "cancelled"]
    assert store.load("resp_race", "").status == "cancelled"
    assert 0 < r.ttl(keys.response("resp_race")) <= 60
