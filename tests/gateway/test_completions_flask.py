"""Whole requests and streams through the Flask test client, with a thread playing the worker."""

from __future__ import annotations

import time

import pytest

from shared.errors import ErrorCode
from shared.protocol import (
    GenerateRequest,
    TokenLogprob,
    WireError,
)
from shared.sampling import SamplingSpec
from tests.support.gateway_app import (
    CHAT,
    CMPL,
    TICK_S,
    USER,
    FakeWorker,
    answer_with,
    assert_openai_error,
    data_of,
    emit,
    sse_events,
)

# -- whole requests, with a thread playing the worker -------------------------------------------------------


@pytest.mark.usefixtures("worker")
def test_completion(client, r, keys, tok) -> None:
    ids = tok.encode(" Paris is lovely.")
    fake = FakeWorker(r, keys, answer_with(r, keys, ids))
    fake.start()
    body = {
        "prompt": "The capital of France is",
        "max_tokens": 20,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "seed": 7,
        "stop_token_ids": [2],
        "ignore_eos": True,
        "min_tokens": 1,
        "priority": -3,
        "user": "u",
        "model": "SmolLM2-135M-Instruct",
    }
    response = client.post(CMPL, json=body)
    fake.join()
    assert response.status_code == 200, response.get_json()
    out = response.get_json()
    (request,) = fake.requests
    assert request.request_id.startswith("cmpl-") and out["id"] == request.request_id
    assert request.prompt_token_ids == tok.encode("The capital of France is")
    assert request.priority == -3
    assert request.sampling == SamplingSpec(
        n=1,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        seed=7,
        max_tokens=20,
        min_tokens=1,
        stop_token_ids=[2],
        ignore_eos=True,
    )
    assert out["object"] == "text_completion" and out["model"] == "SmolLM2-135M-Instruct"
    choice = {
        "index": 0,
        "text": " Paris is lovely.",
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
        "prompt_logprobs": None,
    }
    assert out["choices"] == [choice]
    n_prompt, n_out = len(request.prompt_token_ids), len(ids)
    usage = {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_out,
        "total_tokens": n_prompt + n_out,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert out["usage"] == usage


@pytest.mark.usefixtures("worker")
def test_defaults_and_echo(client, r, keys, tok) -> None:
    fake = FakeWorker(r, keys, answer_with(r, keys, tok.encode(" there")), count=2)
    fake.start()
    first = client.post(CMPL, json={"prompt": "Hello", "echo": True})
    second = client.post(CHAT, json={"messages": USER})
    fake.join()
    completion, chat = fake.requests
    assert completion.sampling.max_tokens == 16 and completion.sampling.temperature == 1.0
    assert chat.sampling.max_tokens == 2048 - len(chat.prompt_token_ids)
    assert first.get_json()["choices"][0]["text"] == "Hello there"
    assert second.get_json()["choices"][0]["message"] == {"role": "assistant", "content": " there"}


def top(token_id: int, lp: float, *alternatives: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(token_id=token_id, logprob=lp, top=dict(alternatives))


@pytest.mark.usefixtures("worker")
def test_logprobs(client, r, keys, tok) -> None:
    ids = tok.encode(" Paris 日")
    alt = tok.encode(" London")[0]

    def respond(request: GenerateRequest) -> None:
        lps = [top(t, -0.25 * (k + 1), (t, -0.25 * (k + 1)), (alt, -3.0)) for k, t in enumerate(ids)]
        emit(r, keys, request.request_id, 0, 0, ids, "length", logprobs=lps)

    fake = FakeWorker(r, keys, respond, count=2)
    fake.start()
    completion = client.post(CMPL, json={"prompt": "x", "logprobs": 2}).get_json()
    chat = client.post(CHAT, json={"messages": USER, "logprobs": True, "top_logprobs": 2}).get_json()
    fake.join()
    assert [q.sampling.logprobs for q in fake.requests] == [2, 2]
    lp = completion["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]).startswith(" Paris")
    assert lp["token_logprobs"] == [-0.25 * (k + 1) for k in range(len(ids))]
    assert list(lp["top_logprobs"][0].items()) == [(" Paris", -0.25), (" London", -3.0)]
    assert lp["text_offset"][:2] == [0, len(" Paris")]
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ids)
    assert content[0] == {
        "token": " Paris",
        "logprob": -0.25,
        "bytes": list(b" Paris"),
        "top_logprobs": [
            {"token": " Paris", "logprob": -0.25, "bytes": list(b" Paris")},
            {"token": " London", "logprob": -3.0, "bytes": list(b" London")},
        ],
    }
    # 日 spans tokens: their bytes add up to the character's UTF-8 encoding.
    assert bytes(b for c in content[1:] for b in c["bytes"]) == " 日".encode()


@pytest.mark.usefixtures("worker")
def test_chat_two_samples_stop_strings_and_usage(client, r, keys, tok) -> None:
    ids = tok.encode(" one, two, three, four")
    fake = FakeWorker(r, keys, answer_with(r, keys, ids, finish=None))
    fake.start()
    out = client.post(CHAT, json={"messages": USER, "n": 2, "stop": ", three", "max_tokens": 10}).get_json()
    fake.join()
    assert out["object"] == "chat.completion"
    assert [c["message"]["content"] for c in out["choices"]] == [" one, two", " one, two"]
    assert [c["finish_reason"] for c in out["choices"]] == ["stop", "stop"]
    (request,) = fake.requests
    assert request.prompt_token_ids == tok.encode_chat([{"role": "user", "content": "hi"}])
    used = out["usage"]["completion_tokens"]
    assert used == 2 * len(tok.encode(" one, two, three"))  # up to the token completing the stop string
    assert r.get(keys.abort_flag(request.request_id)) == "stop"  # both ended here: the worker is stopped


@pytest.mark.usefixtures("worker")
def test_an_error_from_the_worker(client, r, keys) -> None:
    error = WireError(code=ErrorCode.ENGINE_ERROR, message="the engine failed while running it")

    def respond(request: GenerateRequest) -> None:
        emit(r, keys, request.request_id, 0, 0, [], "error", error=error)

    fake = FakeWorker(r, keys, respond)
    fake.start()
    response = client.post(CMPL, json={"prompt": "hi"})
    fake.join()
    assert assert_openai_error(response, 500, "server_error")["code"] == "engine_error"


@pytest.mark.usefixtures("worker", "scheduler")
@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_that_fits_the_context_but_no_kv_pool_is_a_400(client, tok, stream: bool) -> None:
    # The worker holds 40 blocks of 16 tokens (2 kept free); the model's context is 2048 tokens.
    prompt = tok.encode(" word") * 1000
    response = client.post(CMPL, json={"prompt": prompt, "max_tokens": 4, "stream": stream})
    if stream:
        assert response.status_code == 200
        events = sse_events(response.get_data(as_text=True))
        assert events[-1] == "data: [DONE]"
        (error,) = [e["error"] for e in data_of(events) if "error" in e]
        assert error["type"] == "invalid_request_error"
    else:
        error = assert_openai_error(response, 400)
    assert error["code"] == "kv_capacity_exceeded" and "KV blocks" in error["message"]


# -- streaming ----------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("worker")
def test_chat_stream(client, r, keys, tok) -> None:
    ids = tok.encode(" Hi there, friend")
    fake = FakeWorker(r, keys, answer_with(r, keys, ids, finish="stop"))
    fake.start()
    body = {"messages": USER, "stream": True, "stream_options": {"include_usage": True}, "n": 2}
    response = client.post(CHAT, json=body)
    text = response.get_data(as_text=True)
    fake.join()
    assert response.mimetype == "text/event-stream"
    events = sse_events(text)
    assert events[-1] == "data: [DONE]"
    chunks = data_of(events)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == " Hi there, friend"
        assert [c["finish_reason"] for c in mine][-1] == "stop"
        assert all(c["finish_reason"] is None for c in mine[:-1])
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2 * len(ids)
    assert all(c["usage"] is None for c in chunks[:-1])


@pytest.mark.usefixtures("worker")
def test_completion_stream_with_keep_alive_and_stop_string(client, r, keys, tok) -> None:
    ids = tok.encode(" alpha beta gamma delta")

    def respond(request: GenerateRequest) -> None:
        time.sleep(4 * TICK_S)  # nothing for a while: the stream sends keep-alive comments
        answer_with(r, keys, ids)(request)

    fake = FakeWorker(r, keys, respond)
    fake.start()
    response = client.post(CMPL, json={"prompt": "x", "stream": True, "stop": ["a gam"]})
    text = response.get_data(as_text=True)
    events = sse_events(text)
    fake.join()
    assert ": keep-alive\n" in text and ": keep-alive\n\n" not in text  # a comment, never an empty event
    assert events[-1] == "data: [DONE]"
    chunks = data_of(events)
    assert all("usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == " alpha bet"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.usefixtures("worker")
def test_stream_error_event(client, r, keys) -> None:
    error = WireError(code=ErrorCode.KV_CAPACITY_EXCEEDED, message="1000 tokens do not fit in the KV pool")

    def respond(request: GenerateRequest) -> None:
        emit(r, keys, request.request_id, 0, 0, [], "error", error=error)

    fake = FakeWorker(r, keys, respond)
    fake.start()
    events = sse_events(client.post(CMPL, json={"prompt": "x", "stream": True}).get_data(as_text=True))
    fake.join()
    assert events[-1] == "data: [DONE]"
    (event,) = data_of(events)
    assert event["error"]["type"] == "invalid_request_error"
    assert event["error"]["code"] == "kv_capacity_exceeded" and "fit" in event["error"]["message"]
