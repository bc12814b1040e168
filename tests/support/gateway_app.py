"""The gateway in process, against a real Redis: no worker process runs. Where tokens are needed a test
publishes TokenEvents itself (emit), or a thread plays the worker: it reads each request off the requests
stream and answers it (FakeWorker, PacedWorker). Used by the Flask-client tests (tests/gateway/*_flask.py)
and the tests of the request layer (tests/gateway/serving/)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import redis
from flask.testing import FlaskClient

from gateway.serving.errors import HTTP_ERRORS
from gateway.serving.event_hub import EventHub
from gateway.serving.generation import Generation, Limits
from gateway.serving.output import SampleOutput
from gateway.serving.prepare import Prepared
from gateway.serving.tokenization import Tokenizer
from gateway.serving.worker_watch import WorkerWatch
from shared.errors import ErrorCode
from shared.keys import Keys
from shared.protocol import (
    GenerateRequest,
    Heartbeat,
    TokenEvent,
    TokenLogprob,
    WireError,
    encode,
)
from shared.records import push_event
from shared.sampling import SamplingSpec
from shared.settings import DEFAULT_MODEL_NAME
from shared.streams import read_request

TICK_S = 0.05
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
LONG = " hi" * 2100  # more tokens than the tiny model's context of 2048
GRACE_S = 0.5


def add_worker(
    r: redis.Redis,
    keys: Keys,
    wid: str = "w0",
    free: int = 30,
    total: int = 40,
    model: str = DEFAULT_MODEL_NAME,  # what the gateway serves by default
) -> None:
    now = time.time()
    beat = Heartbeat(
        worker_id=wid,
        model=model,
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
                        self.requests.append(read_request(fields))
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
    watch: WorkerWatch | None = None,
    no_worker_grace_s: float = 60,
) -> Generation:
    request = GenerateRequest(
        request_id=f"cmpl-{uuid.uuid4().hex}",
        prompt_token_ids=tok.encode("Once upon a time"),
        sampling=SamplingSpec(n=n, logprobs=0 if logprobs else None),
        arrival_time=time.time(),
    )
    prepared = Prepared(request=request, chat=False, stop=stop or [], want_logprobs=logprobs)
    limits = Limits(
        timeout_s=timeout_s,
        tick_s=TICK_S,
        request_ttl_s=60,
        no_worker_grace_s=no_worker_grace_s,
        redis_outage_grace_s=60,
    )
    return Generation(r, keys, tok, prepared, limits=limits, hub=hub, watch=watch)


def next_change(updates: Iterator[list[SampleOutput]]) -> list[SampleOutput]:
    for changed in updates:
        if changed:
            return changed
    return []


def assert_openai_error(response: Any, status: int, kind: str = "invalid_request_error") -> dict[str, Any]:
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == kind and error["message"]
    assert HTTP_ERRORS[ErrorCode(error["code"])] == (status, kind)  # every error carries its code
    return error


def wait_for(predicate: Callable[[], object], timeout: float = 5.0) -> float:
    """Seconds until predicate holds (fails the test past timeout)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.02)
    return time.monotonic() - start


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


def paced_stream(
    client: FlaskClient, r: redis.Redis, keys: Keys, path: str, body: dict[str, Any], ids: list[int]
) -> list[str]:
    """The events of a stream (body, streamed) whose worker sends ids a token every 10 ms, ending "stop"."""
    r.delete(keys.requests)  # the paced worker reads the stream from its start
    paced = PacedWorker(r, keys, ids, finish="stop")
    paced.start()

    def release() -> None:
        for _ in ids:
            paced.release(1)
            time.sleep(0.01)

    releaser = threading.Thread(target=release)
    releaser.start()
    blocks = sse_events(client.post(path, json={**body, "stream": True}).get_data(as_text=True))
    releaser.join()
    return blocks


def read_events(body: Iterator[bytes], count: int) -> list[str]:
    """count data events (each with its id line) from a streaming response, as blocks of text."""
    text, events = "", []
    while len(events) < count:
        text += next(body).decode()
        *complete, text = text.split("\n\n")
        events.extend(e for e in complete if "data: " in e)
    return events


def run(
    client: FlaskClient,
    r: redis.Redis,
    keys: Keys,
    path: str,
    body: dict[str, Any],
    tokens: list[int],
    headers: dict[str, str] | None = None,
    count: int = 1,
    finish: str = "length",
):
    """Send body and have a worker answer it (count requests: a prompt batch's) with tokens: the response and
    the first request the worker got."""
    r.delete(keys.requests)  # the worker reads the stream from its start: only this request is on it
    fake = FakeWorker(r, keys, answer_with(r, keys, tokens, finish), count=count)
    fake.start()
    response = client.post(path, json=body, headers=headers)
    fake.join(10)
    assert fake.error is None
    return response, (fake.requests[0] if fake.requests else None)


def sent(client: FlaskClient, r: redis.Redis, keys: Keys, path: str, body: dict[str, Any]) -> GenerateRequest:
    """The request a body becomes on the requests stream (its response must be a 200)."""
    response, request = run(client, r, keys, path, body, [5])
    assert response.status_code == 200, response.get_data(as_text=True)
    assert request is not None
    return request
