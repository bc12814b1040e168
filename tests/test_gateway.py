"""The gateway against a real Redis: validation, admission, the token consumer, responses, SSE, gunicorn.

No worker process runs here: where tokens are needed, the test publishes TokenEvents itself, or a
thread plays the worker (it reads the request off the requests stream and answers it).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
import requests
from flask import Flask
from flask.testing import FlaskClient

from gateway.app import create_app
from gateway.serving.errors import HTTP_ERRORS, APIError
from gateway.serving.event_hub import EventHub
from gateway.serving.generation import Generation, GenerationTimeout, Limits
from gateway.serving.output import SampleOutput
from gateway.serving.prepare import Prepared
from gateway.serving.token_receiver import GenerationError
from gateway.serving.tokenization import Tokenizer, load_tokenizer
from gateway.settings import GatewaySettings
from shared.errors import ErrorCode
from shared.keys import Keys
from shared.protocol import (
    AbortMessage,
    GenerateRequest,
    Heartbeat,
    RequestMeta,
    SampleEnd,
    SamplingSpec,
    SchedulerStats,
    TokenEvent,
    TokenLogprob,
    WireError,
    decode,
    encode,
)
from shared.records import push_event

REPO = Path(__file__).resolve().parents[1]
TICK_S = 0.05

# -- fixtures and helpers ----------------------------------------------------------------------------------


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def hub(r: redis.Redis) -> Iterator[EventHub]:
    """The process's pub/sub connection, as a gateway process has one."""
    events = EventHub(r)
    yield events
    events.stop()


@pytest.fixture
def tok(tiny_model_path: str) -> Tokenizer:
    return load_tokenizer(tiny_model_path)


@pytest.fixture
def make_app(redis_url: str, redis_prefix: str, tiny_model_path: str) -> Callable[..., Flask]:
    def make(**overrides: Any) -> Flask:
        values: dict[str, Any] = {
            "redis_url": redis_url,
            "redis_prefix": redis_prefix,
            "model": tiny_model_path,
            "sse_heartbeat_s": TICK_S,
            "request_timeout_s": 10.0,
            **overrides,
        }
        return create_app(GatewaySettings.model_validate(values))

    return make


@pytest.fixture
def client(make_app: Callable[..., Flask]) -> FlaskClient:
    return make_app().test_client()


def add_worker(r: redis.Redis, keys: Keys, wid: str = "w0", free: int = 30, total: int = 40) -> None:
    now = time.time()
    beat = Heartbeat(
        worker_id=wid,
        model="tiny",
        free_blocks=free,
        total_blocks=total,
        block_size=16,
        num_running=3,
        num_waiting=2,
        last_step_time=now,
        started_at=now,
        max_model_len=2048,
        prompt_tokens_total=120,
        generation_tokens_total=45,
    )
    r.hset(keys.worker(wid), mapping=beat.to_hash())  # type: ignore[arg-type]
    r.expire(keys.worker(wid), 60)
    r.sadd(keys.workers, wid)


@pytest.fixture
def worker(r: redis.Redis, keys: Keys) -> None:
    add_worker(r, keys)


def emit(
    r: redis.Redis,
    keys: Keys,
    rid: str,
    index: int,
    start: int,
    token_ids: list[int],
    finish: str | None = None,
    *,
    logprobs: list[TokenLogprob] | None = None,
    record: bool = True,
    error: WireError | None = None,
) -> None:
    """What a worker does after a step: record the tokens and the end, publish the event (record=False:
    only publish it)."""
    event = TokenEvent(
        request_id=rid,
        index=index,
        start=start,
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=finish,
        num_prompt_tokens=3,
        worker_id="w0",
        error=error,
    )
    pipe = r.pipeline(transaction=False)
    if record:
        push_event(pipe, keys, event, ttl_s=60)
    else:
        pipe.publish(keys.events(rid), encode(event))
    pipe.execute()


class FakeWorker(threading.Thread):
    """Takes `count` requests off the requests stream and answers each with `respond(request)`: at once,
    or (hold=True) only once all `count` are queued."""

    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        respond: Callable[[GenerateRequest], None],
        count: int = 1,
        hold: bool = False,
    ) -> None:
        super().__init__(daemon=True)
        self.r, self.keys, self.respond, self.count, self.hold = r, keys, respond, count, hold
        self.requests: list[GenerateRequest] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            last = "0"
            deadline = time.monotonic() + 20
            while len(self.requests) < self.count and time.monotonic() < deadline:
                reply: Any = self.r.xread({self.keys.requests: last}, block=200)
                for _, entries in reply or []:
                    for entry_id, fields in entries:
                        last = entry_id
                        self.requests.append(decode(GenerateRequest, fields["data"]))
                        if not self.hold:
                            self.respond(self.requests[-1])
            if self.hold:
                for request in self.requests:
                    self.respond(request)
        except BaseException as e:
            self.error = e
            raise


def answer_with(r: redis.Redis, keys: Keys, token_ids: list[int], finish: str | None = "length", **kw: Any):
    """A respond function: every sample gets token_ids one event per token, the last one ending it
    with `finish` (None: the sample goes on, as far as the gateway knows)."""

    def respond(request: GenerateRequest) -> None:
        for i in request.sample_indices():
            for pos, token in enumerate(token_ids):
                last = pos == len(token_ids) - 1
                emit(r, keys, request.request_id, i, pos, [token], finish if last else None, **kw)

    return respond


def queued(r: redis.Redis, keys: Keys) -> int:
    return int(r.xlen(keys.requests))  # type: ignore[arg-type]


def sse_events(body: str) -> list[str]:
    """The events of a stream, without its comment lines."""
    lines = (line for line in body.split("\n") if not line.startswith(":"))
    return [block for block in "\n".join(lines).split("\n\n") if block]


def data_of(events: list[str]) -> list[Any]:
    out = []
    for e in events:
        for line in e.split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[len("data: ") :]))
    return out


def event_ids(events: list[str]) -> list[str | None]:
    """Each data event's id (None where it has none)."""
    ids: list[str | None] = []
    for e in events:
        lines = e.split("\n")
        if any(line.startswith("data: {") for line in lines):
            ids.append(next((line[len("id: ") :] for line in lines if line.startswith("id: ")), None))
    return ids


def make_generation(
    hub: EventHub,
    r: redis.Redis,
    keys: Keys,
    tok: Tokenizer,
    *,
    n: int = 1,
    stop: list[str] | None = None,
    logprobs: bool = False,
    timeout_s: float = 5.0,
) -> Generation:
    request = GenerateRequest(
        request_id=f"cmpl-{uuid.uuid4().hex}",
        prompt_token_ids=tok.encode("Once upon a time"),
        sampling=SamplingSpec(n=n, logprobs=0 if logprobs else None),
        arrival_time=time.time(),
    )
    prepared = Prepared(request=request, chat=False, stop=stop or [], want_logprobs=logprobs)
    limits = Limits(
        timeout_s=timeout_s, tick_s=TICK_S, request_ttl_s=60, no_worker_grace_s=60, redis_outage_grace_s=60
    )
    return Generation(r, keys, tok, prepared, limits=limits, hub=hub)


def next_change(updates: Iterator[list[SampleOutput]]) -> list[SampleOutput]:
    for changed in updates:
        if changed:
            return changed
    return []


# -- the consumer: order, dedupe, gaps, stop strings, characters, samples -----------------------------------


def test_duplicates_are_dropped_and_gaps_filled_from_the_record(hub, r, keys, tok) -> None:
    ids = tok.encode(" one two three four five six")
    gen = make_generation(hub, r, keys, tok)
    rid = gen.request_id
    r.rpush(keys.tokens(rid, 0), *ids)  # the record holds every token; some events never arrive
    emit(r, keys, rid, 0, 0, ids[:2], record=False)
    emit(r, keys, rid, 0, 0, ids[:3], record=False)  # a resumed sample re-sends from the start
    emit(r, keys, rid, 0, 1, ids[1:2], record=False)  # a pure duplicate
    emit(r, keys, rid, 0, 5, ids[5:], "length", record=False)  # tokens 3 and 4 were missed
    list(gen.updates())
    gen.close()
    sample = gen.samples[0]
    assert sample.text == " one two three four five six"
    assert (sample.num_tokens, sample.finish_reason) == (len(ids), "length")
    assert gen.aborted is None


def test_tokens_missing_from_the_record_fail_the_request(hub, r, keys, tok) -> None:
    gen = make_generation(hub, r, keys, tok)
    emit(r, keys, gen.request_id, 0, 4, [11], record=False)
    with pytest.raises(GenerationError, match="lost"):
        list(gen.updates())
    gen.close()
    assert r.get(keys.abort_flag(gen.request_id)) == "error"


def test_stop_string_across_events_is_caught_and_never_sent(hub, r, keys, tok) -> None:
    aborts = r.pubsub()
    aborts.subscribe(keys.aborts)
    pieces = [" Hello", " wor", "ld", ",", " and", " more"]
    ids = [tok.encode(p)[0] for p in pieces]
    gen = make_generation(hub, r, keys, tok, stop=["lo world,"])
    rid = gen.request_id
    updates = gen.updates()
    sent = []
    for pos, token in enumerate(ids[:4]):
        emit(r, keys, rid, 0, pos, [token])
        for sample in next_change(updates):
            sent.append(sample.take()[0])
    assert gen.done
    list(updates)
    assert "".join(sent) == " Hel" and not any("lo" in s for s in sent)
    sample = gen.samples[0]
    assert (sample.text, sample.finish_reason, sample.num_tokens) == (" Hel", "stop", 4)
    assert r.get(keys.abort_flag(rid)) == "stop"  # n = 1: the worker is stopped at once
    ttl = r.ttl(keys.abort_flag(rid))
    assert 0 < ttl <= 60  # type: ignore[operator]
    deadline = time.monotonic() + 2
    message = None
    while message is None and time.monotonic() < deadline:
        m = aborts.get_message(timeout=0.2)
        message = m if m and m["type"] == "message" else None
    assert message is not None
    assert decode(AbortMessage, message["data"]) == AbortMessage(request_id=rid, reason="stop")
    aborts.close()
    gen.close()


def test_multibyte_characters_split_across_tokens_are_never_split_in_the_text(hub, r, keys, tok) -> None:
    ids = tok.encode(" 日本 café")
    assert any("\ufffd" in tok.token_text(t) for t in ids), "the test needs characters split across tokens"
    gen = make_generation(hub, r, keys, tok)
    updates = gen.updates()
    sent = []
    for pos, token in enumerate(ids):
        emit(r, keys, gen.request_id, 0, pos, [token], "length" if pos == len(ids) - 1 else None)
        for sample in next_change(updates):
            sent.append(sample.take()[0])
    gen.close()
    assert "".join(sent) == " 日本 café"
    assert not any("\ufffd" in s for s in sent)


def test_two_samples_interleaved_abort_only_once_both_end(hub, r, keys, tok) -> None:
    a = tok.encode(" red green blue")
    b = tok.encode(" cat dog")
    gen = make_generation(hub, r, keys, tok, n=2, stop=[" green"])
    rid = gen.request_id
    updates = gen.updates()
    emit(r, keys, rid, 1, 0, b[:1])
    emit(r, keys, rid, 0, 0, a[:2])  # sample 0 reaches its stop string
    while not gen.samples[0].finished:
        next_change(updates)
    assert not gen.done and r.get(keys.abort_flag(rid)) is None  # sample 1 still runs
    emit(r, keys, rid, 0, 2, a[2:])  # the worker has not heard yet: ignored
    emit(r, keys, rid, 1, 1, b[1:], "length")
    list(updates)
    gen.close()
    s0, s1 = gen.samples
    assert (s0.text, s0.finish_reason, s0.num_tokens) == (" red", "stop", 2)
    assert (s1.text, s1.finish_reason, s1.num_tokens) == (" cat dog", "length", len(b))
    assert gen.num_completion_tokens == 2 + len(b)
    assert r.get(keys.abort_flag(rid)) == "stop"


def test_samples_ended_by_the_worker_need_no_abort(hub, r, keys, tok) -> None:
    gen = make_generation(hub, r, keys, tok, n=2)
    emit(r, keys, gen.request_id, 0, 0, tok.encode(" yes"), "stop")
    emit(r, keys, gen.request_id, 1, 0, tok.encode(" no"), "length")
    list(gen.updates())
    gen.close()
    assert [s.finish_reason for s in gen.samples] == ["stop", "length"]
    assert r.get(keys.abort_flag(gen.request_id)) is None


def test_ends_recorded_without_their_last_event_are_recovered(hub, r, keys, tok) -> None:
    ids = tok.encode(" the end")
    gen = make_generation(hub, r, keys, tok)
    emit(r, keys, gen.request_id, 0, 0, ids[:1])
    # The worker recorded the rest and the end, then died before publishing.
    r.rpush(keys.tokens(gen.request_id, 0), *ids[1:])
    r.hset(keys.finished(gen.request_id), "0", encode(SampleEnd(finish_reason="stop")))
    list(gen.updates())
    gen.close()
    assert (gen.samples[0].text, gen.samples[0].finish_reason) == (" the end", "stop")


def test_an_error_recorded_without_its_event_fails_the_request_with_its_code(hub, r, keys, tok) -> None:
    gen = make_generation(hub, r, keys, tok)
    error = WireError(code=ErrorCode.KV_CAPACITY_EXCEEDED, message="does not fit")
    r.hset(keys.finished(gen.request_id), "0", encode(SampleEnd(finish_reason="error", error=error)))
    with pytest.raises(GenerationError) as info:
        list(gen.updates())
    gen.close()
    assert (info.value.code, info.value.message) == (ErrorCode.KV_CAPACITY_EXCEEDED, "does not fit")


def test_an_error_event_fails_the_request_with_its_code(hub, r, keys, tok) -> None:
    gen = make_generation(hub, r, keys, tok)
    error = WireError(code=ErrorCode.CONTEXT_LENGTH_EXCEEDED, message="prompt of 9000 tokens reaches 2048")
    emit(r, keys, gen.request_id, 0, 0, [], "error", error=error)
    with pytest.raises(GenerationError) as info:
        list(gen.updates())
    gen.close()
    assert info.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert APIError.of(info.value).status == 400  # can never run: the client's problem


def test_a_request_past_its_timeout_is_aborted(hub, r, keys, tok) -> None:
    gen = make_generation(hub, r, keys, tok, timeout_s=0.2)
    with pytest.raises(GenerationTimeout):
        list(gen.updates())
    gen.close()
    assert r.get(keys.abort_flag(gen.request_id)) == "timeout"


# -- bad input: a 4xx in OpenAI's format, and nothing queued ------------------------------------------------

LONG = " hi" * 2100  # more tokens than the tiny model's context of 2048
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

BAD_BODIES = [
    (CMPL, {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    (CMPL, {"prompt": "hi", "temperature": "0.5"}, "temperature"),
    (CMPL, {"prompt": "hi", "stream": "yes"}, "stream"),
    (CMPL, {"prompt": "hi", "bogus": 1, "n": "2"}, "n"),  # an unknown field is ignored, not the rest
    (CMPL, {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
    (CMPL, {"prompt": "hi", "n": 0}, "n"),
    (CMPL, {"prompt": "hi", "temperature": -1}, "temperature"),
    (CMPL, {"prompt": "hi", "top_p": 0}, "top_p"),
    (CMPL, {"prompt": "hi", "top_p": 2}, "top_p"),
    (CMPL, {"prompt": "hi", "top_k": -2}, "top_k"),
    (CMPL, {"prompt": "hi", "min_p": 1.5}, "min_p"),
    (CMPL, {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    (CMPL, {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    (CMPL, {"prompt": "hi", "seed": 2**64}, "seed"),
    (CMPL, {"prompt": "hi", "logprobs": 21}, "logprobs"),
    (CMPL, {"prompt": "hi", "logprobs": -1}, "logprobs"),
    (CMPL, {"prompt": "hi", "stop": [""]}, "stop"),
    (CMPL, {"prompt": "hi", "stop": 5}, "stop"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
    (CMPL, {"prompt": "hi", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    (CMPL, {"prompt": "hi", "stream_options": {"include_usage": True}}, None),
    (CMPL, {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, None),
    (CMPL, {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    (CHAT, {"messages": USER, "prompt_logprobs": 21}, "prompt_logprobs"),
    (CHAT, {"messages": USER, "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    (CHAT, {"messages": USER, "stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, None),
    (CMPL, {"prompt": ""}, "prompt"),
    (CMPL, {"prompt": []}, "prompt"),
    (CMPL, {"prompt": ["one", ""]}, "prompt"),
    (CMPL, {"prompt": [[1], []]}, "prompt"),
    (CMPL, {"prompt": ["one", [1]]}, "prompt"),
    (CMPL, {"prompt": [["one"]]}, "prompt"),
    (CMPL, {"prompt": [[1], [2, -3]]}, "prompt[1][1]"),
    (CMPL, {"prompt": [[1], [10**9]]}, "prompt"),
    (CMPL, {"prompt": ["one", LONG]}, "prompt"),
    (CMPL, {"prompt": ["x"] * 65}, "prompt"),
    (CMPL, {"prompt": [1, "a"]}, "prompt[1]"),
    (CMPL, {"prompt": [-1]}, "prompt[0]"),
    (CMPL, {"prompt": [10**9]}, "prompt"),
    (CMPL, {"prompt": None}, "prompt"),
    (CMPL, {"max_tokens": 5}, "prompt"),
    (CMPL, {"prompt": LONG}, "prompt"),
    (CMPL, {"prompt": " hi" * 2040, "max_tokens": 16}, "max_tokens"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"max_tokens": 5}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"role": "", "content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, None),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "extra": 1, "name": 2}]}, "messages[0].name"),
    (CHAT, {"messages": USER, "logprobs": "yes"}, "logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, None),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": USER, "max_tokens": 10**9}, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, "tools"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (CMPL, {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
]


def assert_openai_error(response: Any, status: int, kind: str = "invalid_request_error") -> dict[str, Any]:
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == kind and error["message"]
    assert HTTP_ERRORS[ErrorCode(error["code"])] == (status, kind)  # every error carries its code
    return error


def test_every_error_code_has_a_status_and_a_type() -> None:
    assert set(HTTP_ERRORS) == set(ErrorCode)
    for code, (status, kind) in HTTP_ERRORS.items():
        body = APIError(code, "m").body()["error"]
        assert body == {"message": "m", "type": kind, "param": None, "code": code}
        assert (400 <= status < 500) == (kind != "server_error"), code
        assert f"| `{code}` | {status} | `{kind}` |" in (REPO / "README.md").read_text(), code


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize(("path", "body", "param"), BAD_BODIES)
def test_bad_bodies_get_400_and_queue_nothing(client, r, keys, path, body, param) -> None:
    error = assert_openai_error(client.post(path, json=body), 400)
    if param is not None:
        assert error["param"] == param
    assert queued(r, keys) == 0


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize(
    ("data", "content_type", "status"),
    [
        (b"{", "application/json", 400),
        (b"[1, 2]", "application/json", 400),
        (b'{"prompt": "x", "temperature": NaN}', "application/json", 400),
        (b'{"prompt": "\xff"}', "application/json", 400),
        # Half a UTF-16 surrogate pair, escaped: valid JSON, but no text.
        (b'{"prompt": "\\ud800"}', "application/json", 400),
        (b'{"model": "\\udfff", "prompt": "x"}', "application/json", 400),
        (b'{"prompt": "x", "stop": ["a\\ud83d"]}', "application/json", 400),
        (b'{"prompt": "x", "\\ud800": 1}', "application/json", 400),
        (b'{"prompt": "x"}', "text/plain", 415),
        (b"prompt=x", "application/x-www-form-urlencoded", 415),
        (b"", None, 415),
    ],
)
def test_malformed_bodies(client, r, keys, data, content_type, status) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    assert_openai_error(client.post(CMPL, data=data, headers=headers), status)
    assert queued(r, keys) == 0


@pytest.mark.usefixtures("worker")
def test_body_too_large_is_413(make_app, r, keys) -> None:
    client = make_app(max_body_bytes=1000).test_client()
    assert_openai_error(client.post(CMPL, json={"prompt": "x" * 2000}), 413)
    assert queued(r, keys) == 0


def test_unknown_model_route_and_method(client) -> None:
    unknown_model = client.post(CMPL, json={"prompt": "x", "model": "gpt-4"})
    assert assert_openai_error(unknown_model, 404)["param"] == "model"
    assert_openai_error(client.get("/v1/nothing"), 404, "not_found_error")
    response = client.get(CMPL)
    assert_openai_error(response, 405)
    assert "POST" in response.headers["Allow"]
    assert_openai_error(client.get("/v1/models/gpt-4"), 404)


@pytest.mark.usefixtures("worker")
def test_api_keys(make_app, r, keys) -> None:
    client = make_app(api_keys="k1, k2").test_client()
    for value in (None, "Bearer nope", "k1", "Basic k1", "Bearer k1k2"):
        headers = {} if value is None else {"Authorization": value}
        denied = client.post(CMPL, json={"prompt": "hi"}, headers=headers)
        assert_openai_error(denied, 401, "authentication_error")
        assert_openai_error(client.get("/v1/models", headers=headers), 401, "authentication_error")
    assert client.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
    for public in ("/health", "/ready", "/metrics", "/openapi.json"):
        assert client.get(public).status_code == 200
    assert queued(r, keys) == 0


# -- admission ----------------------------------------------------------------------------------------------


def test_no_live_worker_is_503_with_retry_after(client, r, keys) -> None:
    response = client.post(CMPL, json={"prompt": "hi"})
    assert_openai_error(response, 503, "server_error")
    assert int(response.headers["Retry-After"]) >= 1
    r.sadd(keys.workers, "gone")  # registered, but its heartbeat expired
    assert_openai_error(client.post(CMPL, json={"prompt": "hi"}), 503, "server_error")
    assert queued(r, keys) == 0


@pytest.mark.usefixtures("worker")
def test_full_queue_is_503_with_retry_after(make_app, r, keys) -> None:
    client = make_app(max_queue_len=5).test_client()
    stats = SchedulerStats(num_waiting=5, num_assigned=0, updated_at=time.time())
    r.hset(keys.scheduler_stats, mapping=stats.to_hash())  # type: ignore[arg-type]
    response = client.post(CHAT, json={"messages": USER})
    assert assert_openai_error(response, 503, "server_error")["code"] == "overloaded"
    assert "Retry-After" in response.headers
    assert queued(r, keys) == 0


# -- operations ---------------------------------------------------------------------------------------------


def test_health_and_ready(client, r, keys) -> None:
    assert client.get("/health").get_json() == {"status": "ok"}
    assert client.get("/ready").status_code == 503
    add_worker(r, keys)
    ready = client.get("/ready")
    assert ready.status_code == 200 and ready.get_json()["workers"] == 1


def test_models(client) -> None:
    listing = client.get("/v1/models").get_json()
    assert listing["object"] == "list"
    (card,) = listing["data"]
    assert card["id"] == "SmolLM2-135M-Instruct" and card["owned_by"] == "pagedserve"
    assert card["max_model_len"] == 2048
    assert client.get("/v1/models/SmolLM2-135M-Instruct").get_json()["id"] == card["id"]


def test_tokenize_and_detokenize(client, tok) -> None:
    text = "The capital of France is Paris. 日本"
    tokens = client.post("/tokenize", json={"prompt": text}).get_json()
    assert tokens["tokens"] == tok.encode(text) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 2048
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).get_json() == {"prompt": text}
    chat = client.post("/tokenize", json={"messages": USER}).get_json()
    assert chat["tokens"] == tok.encode_chat([{"role": "user", "content": "hi"}])
    assert_openai_error(client.post("/detokenize", json={"tokens": [10**9]}), 400)
    assert_openai_error(client.post("/detokenize", json={"tokens": "abc"}), 400)
    assert_openai_error(client.post("/tokenize", json={"prompt": ""}), 400)
    assert_openai_error(client.post("/tokenize", json={"messages": []}), 400)


def test_openapi_describes_every_route(client) -> None:
    app_paths = {
        re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
        for rule in client.application.url_map.iter_rules()
        if rule.endpoint != "static"
    }
    document = client.get("/openapi.json").get_json()
    assert document["openapi"].startswith("3.")
    assert set(document["paths"]) == app_paths
    schemas = document["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "DetokenizeRequest", "Error"} <= set(schemas)
    assert "top_logprobs" in schemas["ChatCompletionRequest"]["properties"]


def test_metrics_use_vllm_names(client, r, keys) -> None:
    add_worker(r, keys, "w0", free=30, total=40)
    buckets = [0, 1, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 4]  # 1, 2, 3 ms and one of 20 s
    stats = SchedulerStats(
        num_waiting=0, num_assigned=0, updated_at=time.time(), queue_time_buckets=buckets,
        queue_time_sum_s=20.006,
    )  # fmt: skip
    r.hset(keys.scheduler_stats, mapping=stats.to_hash())  # type: ignore[arg-type]
    text = client.get("/metrics").get_data(as_text=True)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    assert 'vllm:kv_cache_usage_perc{model_name="SmolLM2-135M-Instruct",worker="w0"} 0.25' in text
    assert 'vllm:generation_tokens_total{model_name="SmolLM2-135M-Instruct",worker="w0"} 45.0' in text
    queue_time = 'vllm:request_queue_time_seconds_bucket{le="%s",model_name="SmolLM2-135M-Instruct"} %s'
    assert queue_time % ("0.002", "1.0") in text and queue_time % ("+Inf", "4.0") in text


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


GRACE_S = 0.5


def wait_for(predicate: Callable[[], object], timeout: float = 5.0) -> float:
    """Seconds until predicate holds (fails the test past timeout)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.mark.usefixtures("worker")
def test_a_client_that_drops_and_never_comes_back_is_aborted_after_the_grace(make_app, r, keys) -> None:
    client = make_app(resume_grace_s=GRACE_S).test_client()
    aborts = r.pubsub()
    aborts.subscribe(keys.aborts)
    response = client.post(CHAT, json={"messages": USER, "stream": True}, buffered=False)
    body = iter(response.response)
    assert b'"role":"assistant"' in next(body)  # the stream is open; no token will ever come
    (entry,) = r.xrange(keys.requests)  # type: ignore[misc]
    rid = decode(GenerateRequest, entry[1]["data"]).request_id
    response.close()  # the client goes away
    assert r.get(keys.abort_flag(rid)) is None  # not at once: it may come back
    waited = wait_for(lambda: r.get(keys.abort_flag(rid)) == "client_disconnect")
    assert GRACE_S * 0.8 < waited < GRACE_S + 2
    messages = [aborts.get_message(timeout=1) for _ in range(2)]
    abort = [decode(AbortMessage, m["data"]) for m in messages if m and m["type"] == "message"]
    assert abort == [AbortMessage(request_id=rid, reason="client_disconnect")]
    aborts.close()


class PacedWorker(FakeWorker):
    """Answers one request token by token, each only once the test lets it (release(k): k more)."""

    def __init__(self, r: redis.Redis, keys: Keys, ids: list[int], finish: str = "length") -> None:
        self.allowed = threading.Semaphore(0)
        self.sent = 0

        def respond(request: GenerateRequest) -> None:
            for pos, token in enumerate(ids):
                assert self.allowed.acquire(timeout=20)
                last = pos == len(ids) - 1
                emit(r, keys, request.request_id, 0, pos, [token], finish if last else None)
                self.sent += 1

        super().__init__(r, keys, respond)

    def release(self, count: int) -> None:
        for _ in range(count):
            self.allowed.release()


def read_events(body: Iterator[bytes], count: int) -> list[str]:
    """count data events (each with its id line) from a streaming response, as blocks of text."""
    text, events = "", []
    while len(events) < count:
        text += next(body).decode()
        *complete, text = text.split("\n\n")
        events.extend(e for e in complete if "data: " in e)
    return events


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize("how", ["last-event-id", "get"])
def test_a_dropped_stream_resumes_after_its_last_event(make_app, r, keys, tok, how: str) -> None:
    client = make_app(resume_grace_s=GRACE_S).test_client()
    ids = tok.encode(" one two three four five six seven eight nine ten")
    expected = tok.decode(ids)
    paced = PacedWorker(r, keys, ids)
    paced.start()
    body = {"prompt": "count", "stream": True, "stop": ["zzz"], "stream_options": {"include_usage": True}}
    first = client.post(CMPL, json=body, buffered=False)
    stream = iter(first.response)
    seen: list[str] = []
    for _ in range(3):  # the client gets three chunks (a token each), then loses its connection
        paced.release(1)
        seen += read_events(stream, 1)
    first.close()
    last_id = event_ids(seen)[-1]
    assert last_id is not None, seen
    rid, cursor = last_id.rsplit(":", 1)
    assert int(cursor) == 3
    paced.release(len(ids))  # meanwhile the worker goes on
    if how == "last-event-id":
        resumed = client.post(CMPL, json=body, headers={"Last-Event-ID": last_id})
    else:
        resumed = client.get(f"{CMPL}/{rid}?stream=true&starting_after={cursor}")
    events = sse_events(resumed.get_data(as_text=True))
    paced.join()
    assert events[-1] == "data: [DONE]"
    chunks = data_of(seen) + data_of(events)
    assert (
        "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected
    )  # no gap, no duplicate
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == len(ids)
    positions = [int(i.rsplit(":", 1)[1]) for i in event_ids(seen + events) if i]
    assert positions == sorted(positions) and positions[-1] == len(ids) + 2  # the usage chunk's
    # A client that had the usage chunk gets only the end of the stream.
    after_usage = client.post(CMPL, json=body, headers={"Last-Event-ID": event_ids(events)[-1]})
    assert sse_events(after_usage.get_data(as_text=True)) == ["data: [DONE]"]
    # Resumed within the grace, then finished: the request was never aborted.
    time.sleep(GRACE_S + 0.3)
    assert r.get(keys.abort_flag(rid)) is None
    # The same request whole, once more, with the non-stream GET.
    whole = client.get(f"{CMPL}/{rid}").get_json()
    assert whole["id"] == rid and whole["choices"][0]["text"] == expected


def test_a_request_record_gives_back_the_request_as_it_was_prepared() -> None:
    request = GenerateRequest(request_id="c", prompt_token_ids=[1], sampling=SamplingSpec(), arrival_time=1)
    prepared = Prepared(
        request=request,
        chat=True,
        stop=["x"],
        prompt_text="hi",
        echo=True,
        want_logprobs=True,
        stream=True,
        include_usage=True,
        created=7,
    )
    meta = decode(RequestMeta, encode(prepared.meta("owner")))
    assert meta.owner == "owner"
    assert Prepared.from_meta(meta, stream=True) == prepared.model_copy(update={"owner": "owner"})
    assert Prepared.from_meta(meta, stream=False).stream is False
    # The record's shape is the one definition; a Prepared adds only how its client reads it.
    assert issubclass(Prepared, RequestMeta) and set(Prepared.model_fields) - set(
        RequestMeta.model_fields
    ) == {"stream"}


@pytest.mark.usefixtures("worker")
def test_only_the_key_that_made_a_request_resumes_it(make_app, r, keys, tok) -> None:
    client = make_app(api_keys="k1,k2", resume_grace_s=GRACE_S).test_client()
    ids = tok.encode(" fine")
    fake = FakeWorker(r, keys, answer_with(r, keys, ids))
    fake.start()
    k1, k2 = ({"Authorization": f"Bearer {k}"} for k in ("k1", "k2"))
    done = client.post(CMPL, json={"prompt": "x", "stream": True}, headers=k1)
    fake.join()
    rid = event_ids(sse_events(done.get_data(as_text=True)))[0].split(":")[0]  # type: ignore[union-attr]
    assert client.get(f"{CMPL}/{rid}?stream=true", headers=k1).status_code == 200
    error = assert_openai_error(client.get(f"{CMPL}/{rid}", headers=k2), 404)
    assert error["code"] == "request_not_found"
    assert_openai_error(client.get(f"{CHAT}/{rid}", headers=k1), 404)  # a completion, not a chat completion
    assert_openai_error(client.post(CMPL, headers={**k1, "Last-Event-ID": f"{rid}:x"}), 400)
    assert_openai_error(client.post(CMPL, headers={**k1, "Last-Event-ID": f"{rid}:1,2"}), 400)  # n is 1
    assert_openai_error(client.get(f"{CMPL}/nothing-{uuid.uuid4().hex}", headers=k1), 404)


# -- several prompts in one completions request -------------------------------------------------------------

PROMPTS = ["The sky is", "Grass is", "Snow is"]
REPLIES = [" blue today.", " green.", " white and cold, very cold."]


def by_prompt(tok: Tokenizer) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's token ids -> the token ids of its reply."""
    return {tuple(tok.encode(p)): tok.encode(reply) for p, reply in zip(PROMPTS, REPLIES)}


def test_a_shared_wakeup_is_set_by_a_message_on_any_of_its_channels(hub, r, keys) -> None:
    wakeup = threading.Event()
    subscriptions = [hub.subscribe(keys.events(f"cmpl-{i}"), 5.0, wakeup) for i in range(3)]
    alone = hub.subscribe(keys.events("cmpl-alone"), 5.0)
    r.publish(keys.events("cmpl-alone"), "elsewhere")
    assert alone.messages.get(timeout=2) == "elsewhere"
    assert not wakeup.is_set()
    r.publish(keys.events("cmpl-2"), "news")
    assert wakeup.wait(2)
    assert subscriptions[2].messages.get_nowait() == "news"
    assert subscriptions[0].messages.empty() and subscriptions[1].messages.empty()


def test_subscriptions_asked_together_are_confirmed_together(hub, r, keys) -> None:
    """A batch's prompts ask for their subscriptions first and wait once they are all asked for; a
    subscription dropped before its confirmation is refused."""
    channels = [keys.events(f"cmpl-{i}") for i in range(8)]
    subscriptions = [hub.subscribe(c, 5.0, wait=False) for c in channels]
    for subscription in subscriptions:
        hub.confirm(subscription, 5.0)
    assert r.pubsub_numsub(*channels) == [(c, 1) for c in channels]
    r.publish(channels[5], "news")
    assert subscriptions[5].messages.get(timeout=2) == "news"
    hub.unsubscribe(subscriptions[0])
    with pytest.raises(redis.TimeoutError):
        hub.confirm(subscriptions[0], 0.5)


@pytest.mark.usefixtures("worker")
def test_several_prompts_make_one_response_indexed_by_prompt_then_sample(client, r, keys, tok) -> None:
    replies = by_prompt(tok)
    fake = FakeWorker(r, keys, lambda q: answer_with(r, keys, replies[tuple(q.prompt_token_ids)])(q), count=4)
    fake.start()
    out = client.post(CMPL, json={"prompt": PROMPTS, "n": 2, "max_tokens": 10, "echo": True}).get_json()
    alone = client.post(CMPL, json={"prompt": [PROMPTS[1]], "n": 2, "max_tokens": 10}).get_json()
    fake.join()
    requests_ = fake.requests
    assert [q.prompt_token_ids for q in requests_[:3]] == [tok.encode(p) for p in PROMPTS]
    assert len({q.request_id for q in requests_}) == 4  # a request of its own per prompt
    assert all(q.sampling.n == 2 and q.sampling.max_tokens == 10 for q in requests_)
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["id"] not in {q.request_id for q in requests_}
    got = [(c["index"], c["text"], c["finish_reason"]) for c in out["choices"]]
    assert got == [(2 * p + s, PROMPTS[p] + REPLIES[p], "length") for p in range(3) for s in range(2)]
    n_prompt = sum(len(tok.encode(p)) for p in PROMPTS)
    n_out = 2 * sum(len(tok.encode(reply)) for reply in REPLIES)
    usage = out["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (n_prompt, n_out)
    assert usage["total_tokens"] == n_prompt + n_out
    # A list of one prompt is that prompt alone: its own request id is the response's.
    assert alone["id"] == requests_[3].request_id
    assert [(c["index"], c["text"]) for c in alone["choices"]] == [(0, REPLIES[1]), (1, REPLIES[1])]


def round_robin(r: redis.Redis, keys: Keys, replies: dict[tuple[int, ...], list[int]], pause_s: float):
    """A respond-all function: the next token of every sample of every request, then a pause, and so on."""

    def respond(request: GenerateRequest) -> None:
        pass  # answered all at once, by respond_all

    def respond_all(requests_: list[GenerateRequest]) -> None:
        longest = max(len(replies[tuple(q.prompt_token_ids)]) for q in requests_)
        for pos in range(longest):
            for q in requests_:
                ids = replies[tuple(q.prompt_token_ids)]
                for i in q.sample_indices():
                    if pos < len(ids):
                        last = pos == len(ids) - 1
                        emit(r, keys, q.request_id, i, pos, [ids[pos]], "length" if last else None)
            time.sleep(pause_s)

    return respond, respond_all


@pytest.mark.usefixtures("worker")
def test_a_stream_of_several_prompts_interleaves_them_as_their_tokens_come(client, r, keys, tok) -> None:
    respond, respond_all = round_robin(r, keys, by_prompt(tok), pause_s=3 * TICK_S)
    fake = FakeWorker(r, keys, respond, count=3, hold=True)
    fake.start()
    body = {"prompt": PROMPTS, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    response = client.post(CMPL, json=body, buffered=False)
    fake.join()
    player = threading.Thread(target=respond_all, args=(fake.requests,), daemon=True)
    player.start()
    text = "".join(part.decode() for part in response.response)
    player.join()
    events = sse_events(text)
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    assert not any(line.startswith("id:") for line in text.split("\n"))  # no resume for several prompts
    chunks = data_of(events)
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "text_completion" for c in chunks)
    order = [c["choices"][0]["index"] for c in chunks if c["choices"]]
    for index in range(6):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == REPLIES[index // 2]
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
    # Interleaved as the tokens came, not one prompt after another.
    assert order.index(4) < len(order) - 1 - order[::-1].index(0)
    usage = chunks[-1]
    n_prompt = sum(len(tok.encode(p)) for p in PROMPTS)
    n_out = 2 * sum(len(tok.encode(reply)) for reply in REPLIES)
    assert usage["choices"] == []
    assert (usage["usage"]["prompt_tokens"], usage["usage"]["completion_tokens"]) == (n_prompt, n_out)
    assert all(c["usage"] is None for c in chunks[:-1])


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize("stream", [False, True])
def test_one_failed_prompt_fails_the_request_and_aborts_the_others(client, r, keys, tok, stream) -> None:
    error = WireError(code=ErrorCode.ENGINE_ERROR, message="the engine failed while running it")
    failing = tok.encode(PROMPTS[1])

    def respond(request: GenerateRequest) -> None:
        if request.prompt_token_ids == failing:
            emit(r, keys, request.request_id, 0, 0, [], "error", error=error)
        else:  # goes on and on, as far as the gateway knows
            emit(r, keys, request.request_id, 0, 0, tok.encode(" and"))

    fake = FakeWorker(r, keys, respond, count=3, hold=True)
    fake.start()
    response = client.post(CMPL, json={"prompt": PROMPTS, "stream": stream})
    fake.join()
    if stream:
        events = sse_events(response.get_data(as_text=True))
        assert events[-1] == "data: [DONE]"
        (failure,) = [e["error"] for e in data_of(events) if "error" in e]
        assert "error" in data_of(events)[-1]  # the stream ends with it
    else:
        failure = assert_openai_error(response, 500, "server_error")
    assert failure["code"] == "engine_error" and failure["message"].startswith("prompt[1]: ")
    assert [r.get(keys.abort_flag(q.request_id)) for q in fake.requests] == ["error"] * 3


@pytest.mark.usefixtures("worker")
def test_a_client_that_drops_a_stream_of_several_prompts_aborts_them_all_at_once(make_app, r, keys) -> None:
    client = make_app(resume_grace_s=30.0).test_client()
    response = client.post(CMPL, json={"prompt": PROMPTS[:2], "stream": True}, buffered=False)
    assert next(iter(response.response)) == b": keep-alive\n"  # the stream is open; no token will come
    rids = [decode(GenerateRequest, entry[1]["data"]).request_id for entry in r.xrange(keys.requests)]  # type: ignore[union-attr]
    assert len(rids) == 2
    response.close()  # the client goes away: nobody resumes a prompt of several, so no grace
    wait_for(lambda: [r.get(keys.abort_flag(rid)) for rid in rids] == ["client_disconnect"] * 2, 2.0)


@pytest.mark.usefixtures("worker")
def test_a_stream_of_several_prompts_catches_up_on_what_it_missed_while_its_hub_reconnected(
    client, r, keys, tok
) -> None:
    replies = by_prompt(tok)

    def play(requests_: list[GenerateRequest]) -> None:
        for q in requests_:
            emit(r, keys, q.request_id, 0, 0, replies[tuple(q.prompt_token_ids)][:1])
        time.sleep(4 * TICK_S)
        (hub,) = [c for c in r.client_list() if c["name"] == f"{keys.prefix}:gateway" and c["sub"] != "0"]
        r.client_kill_filter(_id=hub["id"])
        for q in requests_:  # recorded; published while the hub is away (or just back)
            ids = replies[tuple(q.prompt_token_ids)]
            emit(r, keys, q.request_id, 0, 1, ids[1:], "length")

    fake = FakeWorker(r, keys, lambda q: None, count=2, hold=True)
    fake.start()
    response = client.post(CMPL, json={"prompt": PROMPTS[:2], "stream": True}, buffered=False)
    fake.join()
    player = threading.Thread(target=play, args=(fake.requests,), daemon=True)
    player.start()
    chunks = data_of(sse_events("".join(part.decode() for part in response.response)))
    player.join()
    assert client.application.extensions["pagedserve"].hub.epoch >= 2  # it did connect again
    for index in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == REPLIES[index]
        assert mine[-1]["finish_reason"] == "length"


@pytest.mark.usefixtures("worker")
def test_each_prompt_is_checked_and_the_bad_one_named(client, r, keys) -> None:
    error = assert_openai_error(client.post(CMPL, json={"prompt": ["fine", LONG, "fine"]}), 400)
    assert error["code"] == "context_length_exceeded" and error["message"].startswith("prompt[1]: ")
    assert error["param"] == "prompt"
    error = assert_openai_error(client.post(CMPL, json={"prompt": [[1, 2], [3], [10**9]]}), 400)
    assert error["message"].startswith("prompt[2]: ") and error["param"] == "prompt"
    error = assert_openai_error(client.post(CMPL, json={"prompt": ["fine", ""]}), 400)
    assert "prompt[1]" in error["message"]
    error = assert_openai_error(client.post(CMPL, json={"prompt": ["x"] * 65}), 400)
    assert "at most 64" in error["message"]
    assert queued(r, keys) == 0


@pytest.mark.usefixtures("worker")
def test_back_pressure_counts_every_prompt(make_app, r, keys, tok) -> None:
    client = make_app(max_queue_len=5).test_client()
    stats = SchedulerStats(num_waiting=3, num_assigned=0, updated_at=time.time())
    r.hset(keys.scheduler_stats, mapping=stats.to_hash())  # type: ignore[arg-type]
    response = client.post(CMPL, json={"prompt": PROMPTS})  # 3 + 3 > 5
    assert assert_openai_error(response, 503, "server_error")["code"] == "overloaded"
    assert queued(r, keys) == 0
    replies = by_prompt(tok)
    fake = FakeWorker(r, keys, lambda q: answer_with(r, keys, replies[tuple(q.prompt_token_ids)])(q), count=2)
    fake.start()
    response = client.post(CMPL, json={"prompt": PROMPTS[:2]})  # 3 + 2 fit
    fake.join()
    assert response.status_code == 200 and len(response.get_json()["choices"]) == 2


# -- under gunicorn, with gevent workers --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


GUNICORN_REDIS_CONNECTIONS = 8


@pytest.fixture
def gunicorn_url(redis_url, redis_prefix, tiny_model_path, tmp_path) -> Iterator[str]:
    port = _free_port()
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "REDIS_PREFIX": redis_prefix,
        "MODEL": tiny_model_path,
        "PORT": str(port),
        "GATEWAY_WORKERS": "1",
        "SSE_HEARTBEAT_S": "0.1",
        "RESUME_GRACE_S": "0.5",
        "REDIS_MAX_CONNECTIONS": str(GUNICORN_REDIS_CONNECTIONS),
        "LOG_LEVEL": "WARNING",
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics"),
    }
    log = (tmp_path / "gunicorn.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "gateway"], env=env, cwd=REPO, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "gunicorn.log").read_text()
            try:
                if requests.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:  # not listening yet, or its worker still loading
                pass
            assert time.monotonic() < deadline, "gunicorn did not start"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()  # exec'd: this is gunicorn's master, which stops its workers gracefully
        proc.wait(timeout=30)
        log.close()


def test_gunicorn_gevent_worker_holds_many_streams_at_once(gunicorn_url, r, keys, tok) -> None:
    add_worker(r, keys)
    ids = tok.encode(" in parallel")
    count = 200
    # The fake worker answers nothing until all requests are queued: they all wait at once, on one
    # gunicorn worker process, on one pub/sub connection and a few pooled ones.
    fake = FakeWorker(r, keys, answer_with(r, keys, ids), count=count, hold=True)
    fake.start()
    bodies: list[str] = []

    def stream() -> None:
        body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
        with requests.post(f"{gunicorn_url}/v1/completions", json=body, stream=True, timeout=60) as response:
            bodies.append(response.text)

    clients = [threading.Thread(target=stream) for _ in range(count)]
    for t in clients:
        t.start()
    while len(fake.requests) < count and fake.is_alive():
        started = time.monotonic()
        assert requests.get(f"{gunicorn_url}/health", timeout=5).status_code == 200
        assert time.monotonic() - started < 1.0  # the waiting streams do not block the process
        time.sleep(0.05)
    connections = [c for c in r.client_list() if c["name"] == f"{keys.prefix}:gateway"]
    assert 1 <= len(connections) <= GUNICORN_REDIS_CONNECTIONS + 1  # the pool, and the hub's pub/sub
    for t in clients:
        t.join(timeout=60)
    fake.join()
    assert fake.error is None and len(bodies) == count
    for body in bodies:
        chunks = data_of(sse_events(body))
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " in parallel"
        assert body.endswith("data: [DONE]\n\n")
    metrics = requests.get(f"{gunicorn_url}/metrics", timeout=5).text
    # Counted in the worker process's multiprocess files, summed by the scrape.
    expected = f'vllm:e2e_request_latency_seconds_count{{model_name="SmolLM2-135M-Instruct"}} {count}.0'
    assert expected in metrics


def test_the_openai_client_reads_a_stream_that_pauses_mid_way(gunicorn_url, r, keys, tok) -> None:
    """Keep-alive comments come between events that carry ids: no blank line may follow them, or the client
    (which keeps the last id) takes the blank line for an event without data."""
    add_worker(r, keys)
    ids = tok.encode(" slow and steady")

    def respond(request: GenerateRequest) -> None:
        emit(r, keys, request.request_id, 0, 0, ids[:1])
        time.sleep(0.5)  # five keep-alive ticks
        emit(r, keys, request.request_id, 0, 1, ids[1:], "length")

    fake = FakeWorker(r, keys, respond)
    fake.start()
    client = openai.OpenAI(base_url=f"{gunicorn_url}/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt="x", stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == tok.decode(ids)
    fake.join()
    assert fake.error is None


def test_gunicorn_notices_a_client_that_hangs_up(gunicorn_url, r, keys) -> None:
    add_worker(r, keys)
    host, port = gunicorn_url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "x", "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert b"200 OK" in conn.recv(4096)
        deadline = time.monotonic() + 5
        while not r.xlen(keys.requests):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    (entry,) = r.xrange(keys.requests)  # type: ignore[misc]
    rid = decode(GenerateRequest, entry[1]["data"]).request_id
    deadline = time.monotonic() + 5
    while r.get(keys.abort_flag(rid)) is None:
        assert time.monotonic() < deadline, "the hang-up went unnoticed"
        time.sleep(0.05)
    assert r.get(keys.abort_flag(rid)) == "client_disconnect"


def raw_exchange(url: str, request: bytes) -> tuple[int, dict[str, Any]]:
    """Send bytes as they are; the status and the JSON body of the answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), answer[:300]
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (b"GET /v1/models?" + b"x" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),
        (
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"y" * 9000 + b"\r\n\r\n",
            431,
            "headers_too_large",
        ),
        (b"NOT A REQUEST\r\n\r\n", 400, "invalid_request"),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            + b"".join(b"%x\r\n%s\r\n" % (65536, b"z" * 65536) for _ in range(80))
            + b"0\r\n\r\n",
            413,
            "body_too_large",
        ),
    ],
    ids=["long-url", "large-header", "garbage", "chunked-5mb"],
)
def test_gunicorn_refusals_are_openai_errors(
    gunicorn_url, request_bytes: bytes, status: int, code: str
) -> None:
    got, body = raw_exchange(gunicorn_url, request_bytes)
    assert got == status and body["error"]["code"] == code and body["error"]["message"], body


def test_launcher_help_lists_every_setting() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines anywhere
    for name in GatewaySettings.model_fields:
        assert f"env {name.upper()}," in text, name
