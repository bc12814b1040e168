"""Resuming: a client that drops is aborted after the grace unless it resumes (Last-Event-ID, or GET with
starting_after), and only the API key that made a request resumes it."""

from __future__ import annotations

import time
import uuid

import pytest

from gateway.serving.prepare import Prepared
from shared.protocol import (
    AbortMessage,
    GenerateRequest,
    RequestMeta,
    decode,
    encode,
)
from shared.sampling import SamplingSpec
from shared.streams import read_request
from tests.support.gateway_app import (
    CHAT,
    CMPL,
    GRACE_S,
    USER,
    FakeWorker,
    PacedWorker,
    answer_with,
    assert_openai_error,
    data_of,
    event_ids,
    read_events,
    run,
    sse_events,
    wait_for,
)


@pytest.mark.usefixtures("worker")
def test_a_client_that_drops_and_never_comes_back_is_aborted_after_the_grace(make_app, r, keys) -> None:
    client = make_app(resume_grace_s=GRACE_S).test_client()
    aborts = r.pubsub()
    aborts.subscribe(keys.aborts)
    response = client.post(CHAT, json={"messages": USER, "stream": True}, buffered=False)
    body = iter(response.response)
    assert b'"role":"assistant"' in next(body)  # the stream is open; no token will ever come
    (entry,) = r.xrange(keys.requests)  # type: ignore[misc]
    rid = read_request(entry[1]).request_id
    response.close()  # the client goes away
    assert r.get(keys.abort_flag(rid)) is None  # not at once: it may come back
    waited = wait_for(lambda: r.get(keys.abort_flag(rid)) == "client_disconnect")
    assert GRACE_S * 0.8 < waited < GRACE_S + 2
    messages = [aborts.get_message(timeout=1) for _ in range(2)]
    abort = [decode(AbortMessage, m["data"]) for m in messages if m and m["type"] == "message"]
    assert abort == [AbortMessage(request_id=rid, reason="client_disconnect")]
    aborts.close()


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


@pytest.mark.usefixtures("worker")
def test_a_request_the_client_names_has_that_id_once_and_can_be_fetched_by_it(make_app, r, keys, tok) -> None:
    client = make_app().test_client()
    ids = tok.encode(" named and found")
    name = f"job-{uuid.uuid4().hex[:8]}.1"
    response, request = run(client, r, keys, CHAT, {"messages": USER}, ids, headers={"X-Request-Id": name})
    assert response.status_code == 200, response.get_data(as_text=True)
    assert request is not None and request.request_id == name
    assert response.get_json()["id"] == name and response.headers["X-Request-Id"] == name
    fetched = client.get(f"{CHAT}/{name}")
    assert fetched.status_code == 200
    assert fetched.get_json()["choices"] == response.get_json()["choices"]
    # The name is taken while its record lives: the same name again is refused, and nothing is queued.
    again = client.post(CHAT, json={"messages": USER}, headers={"X-Request-Id": name})
    error = assert_openai_error(again, 409)
    assert (error["code"], error["param"]) == ("request_id_in_use", "X-Request-Id")
    assert r.xlen(keys.requests) == 1


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize("name", ["", "a:1", "{slot}", "a/b", "x" * 129, "sp ace"])
def test_a_request_id_that_cannot_be_one_is_a_400_naming_the_header(make_app, r, keys, name: str) -> None:
    client = make_app().test_client()
    r.delete(keys.requests)
    response = client.post(CHAT, json={"messages": USER}, headers={"X-Request-Id": name})
    assert assert_openai_error(response, 400)["param"] == "X-Request-Id"
    assert r.xlen(keys.requests) == 0


@pytest.mark.usefixtures("worker")
def test_the_prompts_of_a_named_batch_are_named_after_it(make_app, r, keys, tok) -> None:
    client = make_app().test_client()
    name = f"batch-{uuid.uuid4().hex[:8]}"
    body = {"prompt": ["one", "two"]}
    headers = {"X-Request-Id": name}
    response, _ = run(client, r, keys, CMPL, body, tok.encode(" x"), headers=headers, count=2)
    assert response.status_code == 200, response.get_data(as_text=True)
    queued_ids = sorted(read_request(fields).request_id for _, fields in r.xrange(keys.requests))
    assert queued_ids == [f"{name}-0", f"{name}-1"]
    again = client.post(CMPL, json=body, headers=headers)
    assert assert_openai_error(again, 409)["code"] == "request_id_in_use"
