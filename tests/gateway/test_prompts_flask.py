"""Several prompts in one completions request: one queued request per prompt, one response for all."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from gateway.serving.tokenization import Tokenizer
from shared.errors import ErrorCode
from shared.keys import Keys
from shared.protocol import (
    GenerateRequest,
    SchedulerStats,
    WireError,
)
from shared.settings import DEFAULT_MODEL_NAME
from shared.streams import read_request
from tests.support.gateway_app import (
    CMPL,
    LONG,
    TICK_S,
    FakeWorker,
    answer_with,
    assert_openai_error,
    data_of,
    emit,
    queued,
    sse_events,
    wait_for,
)

# -- several prompts in one completions request -------------------------------------------------------------

PROMPTS = ["The sky is", "Grass is", "Snow is"]
REPLIES = [" blue today.", " green.", " white and cold, very cold."]


def by_prompt(tok: Tokenizer) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's token ids -> the token ids of its reply."""
    return {tuple(tok.encode(p)): tok.encode(reply) for p, reply in zip(PROMPTS, REPLIES)}


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
    rids = [read_request(entry[1]).request_id for entry in r.xrange(keys.requests)]  # type: ignore[union-attr]
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
    stats = SchedulerStats(
        num_waiting=3, num_assigned=0, updated_at=time.time(), waiting_by_model={DEFAULT_MODEL_NAME: 3}
    )
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
