"""The gateway's output side against a real Redis: logprobs, stop tokens and strings, echo with prompt
logprobs, vLLM's prompt_logprobs and stop_reason, continuous usage and cached tokens.

No worker runs (tests/support/gateway_app.py): a thread reads each request off the requests stream and
publishes hand-made TokenEvents on its channel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis
from flask.testing import FlaskClient

from gateway.serving.output import SampleOutput
from gateway.serving.token_receiver import SampleTokens
from gateway.serving.tokenization import Tokenizer
from shared.keys import Keys
from shared.protocol import GenerateRequest, TokenEvent, TokenLogprob
from shared.records import push_event
from tests.support.gateway_app import (
    CHAT,
    CMPL,
    USER,
    FakeWorker,
    PacedWorker,
    data_of,
    event_ids,
    read_events,
    sse_events,
)

# Every test has a live worker in the registry, so requests are admitted.
pytestmark = pytest.mark.usefixtures("worker")


def lp(token_id: int, logprob: float, *top: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(token_id=token_id, logprob=logprob, top=dict(top))


def publish(
    r: redis.Redis, keys: Keys, request: GenerateRequest, index: int, start: int, **fields: Any
) -> None:
    """Record and publish one event of a sample, as its worker does."""
    event = TokenEvent(
        request_id=request.request_id,
        index=index,
        start=start,
        num_prompt_tokens=len(request.prompt_token_ids),
        worker_id="w0",
        **fields,
    )
    pipe = r.pipeline(transaction=False)
    push_event(pipe, keys, event, ttl_s=60)
    pipe.execute()


def answer(
    r: redis.Redis,
    keys: Keys,
    token_ids: list[int],
    finish: str = "length",
    *,
    logprobs: Callable[[int], TokenLogprob] | None = None,
    first: Callable[[GenerateRequest, int], dict[str, Any]] | None = None,
) -> Callable[[GenerateRequest], None]:
    """Every sample gets token_ids one event per token, the last ending it with finish; logprobs(position)
    gives each token's logprobs, first(request, sample) the extra fields of a sample's first event."""

    def respond(request: GenerateRequest) -> None:
        for i in request.sample_indices():
            for pos, token in enumerate(token_ids):
                extra = first(request, i) if first is not None and pos == 0 else {}
                publish(
                    r,
                    keys,
                    request,
                    i,
                    pos,
                    token_ids=[token],
                    logprobs=None if logprobs is None else [logprobs(pos)],
                    finish_reason=finish if pos == len(token_ids) - 1 else None,
                    **extra,
                )

    return respond


def run(
    client: FlaskClient, r: redis.Redis, keys: Keys, path: str, body: dict[str, Any], respond: Any
) -> tuple[GenerateRequest, Any]:
    """POST body with a fake worker answering it: the request the worker got, and the response."""
    r.delete(keys.requests)  # the fake worker reads the stream from its start: only this request is there
    fake = FakeWorker(r, keys, respond)
    fake.start()
    response = client.post(path, json=body)
    text = response.get_data(as_text=True)
    fake.join()
    assert response.status_code == 200, text
    (request,) = fake.requests
    return request, (sse_events(text) if body.get("stream") else response.get_json())


def stream_text(chunks: list[Any]) -> str:
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


# -- logprobs: the sampled token is always in a completion's top_logprobs; chat shows exactly k --------------


def test_completion_top_logprobs_hold_the_sampled_token(client, r, keys, tok) -> None:
    ids = tok.encode(" Paris is")
    other, third = tok.encode(" London")[0], tok.encode(" Rome")[0]
    # The first token is not among the top 2 the worker sends; the second is.
    tops = [lp(ids[0], -2.0, (other, -0.5), (third, -1.0)), lp(ids[1], -0.1, (ids[1], -0.1), (other, -3.0))]
    respond = answer(r, keys, ids, logprobs=tops.__getitem__)
    request, out = run(client, r, keys, CMPL, {"prompt": "x", "logprobs": 0}, respond)
    assert request.sampling.logprobs == 0
    top_logprobs = out["choices"][0]["logprobs"]["top_logprobs"]
    assert top_logprobs == [{" Paris": -2.0}, {" is": -0.1}]  # the top 0, and the sampled token

    _, out = run(client, r, keys, CMPL, {"prompt": "x", "logprobs": 2}, respond)
    top_logprobs = out["choices"][0]["logprobs"]["top_logprobs"]
    assert list(top_logprobs[0].items()) == [(" London", -0.5), (" Rome", -1.0), (" Paris", -2.0)]
    assert list(top_logprobs[1].items()) == [(" is", -0.1), (" London", -3.0)]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_zero_and_k(client, r, keys, tok, stream: bool) -> None:
    ids = tok.encode(" Paris is")
    other, third = tok.encode(" London")[0], tok.encode(" Rome")[0]

    def tops(pos: int) -> TokenLogprob:
        return lp(ids[pos], -2.0, (other, -0.5), (third, -1.0))

    for k in (0, 1, 2):
        body = {"messages": USER, "logprobs": True, "top_logprobs": k, "stream": stream}
        request, out = run(client, r, keys, CHAT, body, answer(r, keys, ids, logprobs=tops))
        assert request.sampling.logprobs == k
        if stream:
            chosen = [c["choices"][0]["logprobs"] for c in data_of(out)]
            content = [e for logprobs in chosen if logprobs for e in logprobs["content"]]
        else:
            content = out["choices"][0]["logprobs"]["content"]
        assert [c["token"] for c in content] == [" Paris", " is"]
        assert all(c["logprob"] == -2.0 for c in content)
        expected = [" London", " Rome"][:k]  # exactly k: the sampled token is not added
        assert all([t["token"] for t in c["top_logprobs"]] == expected for c in content)


# -- stop tokens and stop strings: stop_reason, include_stop_str_in_output ----------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_is_counted_but_not_shown(client, r, keys, tok, stream: bool, include: bool) -> None:
    ids = tok.encode(" one two")
    stop = tok.encode(" end")[0]
    body = {"prompt": "x", "stop_token_ids": [stop], "stream": stream, "include_stop_str_in_output": include}
    if stream:
        body["stream_options"] = {"include_usage": True}
    _, out = run(client, r, keys, CMPL, body, answer(r, keys, [*ids, stop], "stop"))
    if stream:
        chunks = data_of(out)
        text, last, usage = stream_text(chunks), chunks[-2]["choices"][0], chunks[-1]["usage"]
        assert all(c["choices"][0]["stop_reason"] is None for c in chunks[:-2])
    else:
        (last,), usage = out["choices"], out["usage"]
        text = last["text"]
    assert text == (" one two end" if include else " one two")
    assert last["finish_reason"] == "stop" and last["stop_reason"] == stop
    assert usage["completion_tokens"] == len(ids) + 1


@pytest.mark.parametrize("stream", [False, True])
def test_eos_and_length_have_no_stop_reason(client, r, keys, tok, stream: bool) -> None:
    ids = tok.encode(" one two")
    eos = tok.hf.eos_token_id
    for tokens, finish in (([*ids, eos], "stop"), (ids, "length")):
        body = {"messages": USER, "stream": stream, "stop_token_ids": tok.encode(" zebra")[:1]}
        _, out = run(client, r, keys, CHAT, body, answer(r, keys, tokens, finish))
        if stream:
            chunks = data_of(out)
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            last = chunks[-1]["choices"][0]
        else:
            (last,) = out["choices"]
            text = last["message"]["content"]
        assert text == " one two"
        assert last["finish_reason"] == finish and last["stop_reason"] is None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_is_the_stop_reason_and_kept_when_asked(client, r, keys, tok, stream, include) -> None:
    ids = tok.encode(" alpha beta gamma delta")
    body = {"prompt": "x", "stop": ["zzz", "a gam"], "stream": stream, "include_stop_str_in_output": include}
    _, out = run(client, r, keys, CMPL, body, answer(r, keys, ids))
    if stream:
        chunks = data_of(out)
        text, last = stream_text(chunks), chunks[-1]["choices"][0]
        assert last["text"]  # the end rides with the last text (here, what was held back)
    else:
        (last,) = out["choices"]
        text = last["text"]
    assert text == (" alpha beta gam" if include else " alpha bet")  # nothing after the stop string
    assert last["finish_reason"] == "stop" and last["stop_reason"] == "a gam"


def test_with_include_stop_str_nothing_is_held_back(tok) -> None:
    """The text sent while streaming is a prefix of the final text either way; with the stop string kept,
    none of it need wait for the next tokens."""
    for include, sent_first in ((False, " alpha "), (True, " alpha beta")):
        sample = SampleOutput(0, tok.detokenizer(tok.encode("x")), ["a gam"], False, include_stop_str=include)
        ids = tok.encode(" alpha beta gamma delta")
        sample.add(SampleTokens(0, ids[:2], [None, None]))
        assert sample.take()[0] == sent_first
        sample.add(SampleTokens(0, ids[2:], [None] * (len(ids) - 2)))
        assert sent_first + sample.take()[0] == (" alpha beta gam" if include else " alpha bet")
        assert sample.stop_reason == "a gam" and sample.stopped_here


# -- echo with logprobs, and vLLM's prompt_logprobs ---------------------------------------------------------


def prompt_logprobs_of(tok: Tokenizer, prompt_ids: list[int]) -> list[TokenLogprob | None]:
    """Made-up prompt logprobs: token i has -i, and the top two are token 0 (-0.5) and the prompt token itself
    on even positions, token 1 (-0.25) on odd ones (where the prompt token is not among them)."""
    out: list[TokenLogprob | None] = [None]
    for i, token in enumerate(prompt_ids[1:], 1):
        second = (token, -float(i)) if i % 2 == 0 else (1, -0.25)
        out.append(lp(token, -float(i), (0, -0.5), second))
    return out


def first_event_with_prompt_logprobs(tok: Tokenizer) -> Callable[[GenerateRequest, int], dict[str, Any]]:
    def first(request: GenerateRequest, index: int) -> dict[str, Any]:
        return {"prompt_logprobs": prompt_logprobs_of(tok, request.prompt_token_ids), "num_cached_tokens": 0}

    return first


def test_echo_with_logprobs_shows_the_prompt_tokens_first(client, r, keys, tok) -> None:
    prompt = "Hello world, said the"
    prompt_ids = tok.encode(prompt)
    ids = tok.encode(" cat")
    respond = answer(
        r, keys, ids, logprobs=lambda pos: lp(ids[pos], -0.75), first=first_event_with_prompt_logprobs(tok)
    )
    request, out = run(
        client, r, keys, CMPL, {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 5}, respond
    )
    assert request.sampling.prompt_logprobs == 1 and request.sampling.logprobs == 1
    (choice,) = out["choices"]
    assert choice["text"] == prompt + " cat"
    assert choice["prompt_logprobs"] is None  # not asked for: echo shows them in logprobs
    logprobs = choice["logprobs"]
    n = len(prompt_ids)
    assert logprobs["tokens"] == [tok.token_text(t) for t in prompt_ids + ids]
    assert logprobs["token_logprobs"] == [None, *(-float(i) for i in range(1, n)), -0.75]
    top = logprobs["top_logprobs"]
    assert top[0] is None
    # The top 1 (token 1, then token 0), and the prompt token's own where it is not that one.
    assert top[1] == {tok.token_text(1): -0.25, tok.token_text(prompt_ids[1]): -1.0}
    assert top[2] == {tok.token_text(0): -0.5, tok.token_text(prompt_ids[2]): -2.0}
    assert top[n] == {" cat": -0.75}
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert [prompt[o : o + len(t)] for o, t in zip(offsets[:n], logprobs["tokens"][:n])] == logprobs[
        "tokens"
    ][:n]
    assert offsets[n] == len(prompt)


def test_echo_with_logprobs_streams_the_prompt_with_the_first_tokens(client, r, keys, tok) -> None:
    prompt = "Hello world"
    prompt_ids = tok.encode(prompt)
    ids = tok.encode(" again and again")
    respond = answer(
        r, keys, ids, first=first_event_with_prompt_logprobs(tok), logprobs=lambda pos: lp(ids[pos], -1.0)
    )
    body = {"prompt": prompt, "echo": True, "logprobs": 0, "stream": True, "n": 2}
    _, events = run(client, r, keys, CMPL, body, respond)
    chunks = data_of(events)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        # No chunk of the prompt alone ahead of the tokens (the events may come in one chunk or several).
        assert mine[0]["text"].startswith(prompt + " again")
        num_tokens = len(mine[0]["logprobs"]["tokens"]) - len(prompt_ids)
        assert mine[0]["logprobs"]["tokens"] == [tok.token_text(t) for t in prompt_ids + ids[:num_tokens]]
        assert mine[0]["logprobs"]["token_logprobs"] == [None, -1.0] + [-1.0] * num_tokens
        assert "".join(c["text"] for c in mine) == prompt + " again and again"
        tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert tokens == [tok.token_text(t) for t in prompt_ids + ids]
    positions = [int(i.rsplit(":", 1)[1].split(",")[0]) for i in event_ids(events) if i]
    assert positions[0] >= 1  # a client that resumes from any event has had the echo


@pytest.mark.parametrize("k", [0, 2])
def test_prompt_logprobs_in_vllm_shape(client, r, keys, tok, k: int) -> None:
    prompt_ids = tok.encode("Hello world, said the")
    respond = answer(r, keys, tok.encode(" cat"), first=first_event_with_prompt_logprobs(tok))
    request, out = run(client, r, keys, CMPL, {"prompt": prompt_ids, "prompt_logprobs": k, "n": 2}, respond)
    assert request.sampling.prompt_logprobs == k
    text = tok.token_text
    for choice in out["choices"]:
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(prompt_ids) and plp[0] is None
        # Position 1: the prompt token is not among the top two (its rank is not known); position 2: it is.
        own1, own2 = str(prompt_ids[1]), str(prompt_ids[2])
        expected1 = {own1: {"logprob": -1.0, "rank": None, "decoded_token": text(prompt_ids[1])}}
        expected2 = {own2: {"logprob": -2.0, "rank": 2, "decoded_token": text(prompt_ids[2])}}
        if k:
            expected1 |= {
                "1": {"logprob": -0.25, "rank": 1, "decoded_token": text(1)},
                "0": {"logprob": -0.5, "rank": 2, "decoded_token": text(0)},
            }
            expected2 |= {"0": {"logprob": -0.5, "rank": 1, "decoded_token": text(0)}}
        assert plp[1] == expected1 and next(iter(plp[1])) == own1  # the prompt token first
        assert plp[2] == expected2
    _, chat = run(client, r, keys, CHAT, {"messages": USER, "prompt_logprobs": k}, respond)
    assert "prompt_logprobs" not in chat["choices"][0]  # vLLM: beside the choices, once
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(tok.encode_chat(USER))


def test_a_request_read_back_from_its_record_has_no_prompt_logprobs(client, r, keys, tok) -> None:
    prompt = "Hello world"
    ids = tok.encode(" again")
    respond = answer(
        r, keys, ids, first=first_event_with_prompt_logprobs(tok), logprobs=lambda pos: lp(ids[pos], -1.0)
    )
    body = {"prompt": prompt, "echo": True, "logprobs": 0, "prompt_logprobs": 1}
    request, live = run(client, r, keys, CMPL, body, respond)
    assert live["choices"][0]["prompt_logprobs"] is not None
    again = client.get(f"{CMPL}/{request.request_id}").get_json()
    (choice,) = again["choices"]
    assert choice["text"] == live["choices"][0]["text"]
    assert choice["prompt_logprobs"] is None  # the record keeps tokens only
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == live["choices"][0]["logprobs"]["tokens"]
    assert logprobs["token_logprobs"] == [None] * len(logprobs["tokens"])
    assert logprobs["top_logprobs"] == [None] * len(logprobs["tokens"])


def test_a_resumed_echo_stream_echoes_only_to_a_client_that_has_had_nothing(client, r, keys, tok) -> None:
    r.delete(keys.requests)
    ids = tok.encode(" one two three four")
    paced = PacedWorker(r, keys, ids)
    paced.start()
    body = {"prompt": "count", "echo": True, "logprobs": 0, "stream": True}
    first = client.post(CMPL, json=body, buffered=False)
    paced.release(1)
    seen = read_events(iter(first.response), 1)
    first.close()  # the client has the prompt and the first token, then drops
    paced.release(len(ids))
    last_id = event_ids(seen)[-1]
    assert last_id is not None
    resumed = client.post(CMPL, json=body, headers={"Last-Event-ID": last_id})
    events = sse_events(resumed.get_data(as_text=True))
    paced.join()
    chunks = data_of(seen) + data_of(events)
    expected = [tok.token_text(t) for t in tok.encode("count") + ids]
    assert stream_text(chunks) == "count" + tok.decode(ids)
    assert [
        t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]
    ] == (expected)
    # From the start (no cursor): the whole stream again, the prompt with the first chunk.
    rid = last_id.rsplit(":", 1)[0]
    again = data_of(sse_events(client.get(f"{CMPL}/{rid}?stream=true").get_data(as_text=True)))
    assert again[0]["choices"][0]["text"].startswith("count one")
    assert stream_text(again) == "count" + tok.decode(ids)


# -- usage: continuous usage stats, cached tokens -----------------------------------------------------------


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, r, keys, tok, path) -> None:
    ids = tok.encode(" one two three")
    body: dict[str, Any] = {
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    body |= {"prompt": "x"} if path == CMPL else {"messages": USER}
    request, events = run(client, r, keys, path, body, answer(r, keys, ids))
    chunks = data_of(events)
    n_prompt = len(request.prompt_token_ids)
    used = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == n_prompt for c in chunks)
    assert all(c["usage"]["total_tokens"] == n_prompt + c["usage"]["completion_tokens"] for c in chunks)
    assert used == sorted(used) and used[-1] == len(ids) and chunks[-1]["choices"] == []
    assert used[1] >= 1 and used[-2] == len(ids)
    if path == CHAT:
        assert used[0] == 0  # the role chunk, before any token


def test_without_continuous_usage_stats_only_the_last_chunk_has_usage(client, r, keys, tok) -> None:
    body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    _, events = run(client, r, keys, CMPL, body, answer(r, keys, tok.encode(" one two")))
    chunks = data_of(events)
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_are_the_most_any_sample_found(client, r, keys, tok, stream: bool) -> None:
    ids = tok.encode(" one two")

    def first(request: GenerateRequest, index: int) -> dict[str, Any]:
        return {"num_cached_tokens": 16 * (index + 1)}

    body: dict[str, Any] = {"prompt": "x" * 40, "n": 2, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    _, out = run(client, r, keys, CMPL, body, answer(r, keys, ids, first=first))
    usage = data_of(out)[-1]["usage"] if stream else out["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 32}
    _, out = run(client, r, keys, CHAT, {"messages": USER}, answer(r, keys, ids))  # no worker said
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_prompt_information_is_taken_from_the_first_event_only(client, r, keys, tok) -> None:
    ids = tok.encode(" one two")

    def respond(request: GenerateRequest) -> None:
        publish(r, keys, request, 0, 0, token_ids=ids[:1], num_cached_tokens=8)
        # A resumed sample sends its first token again with other figures: a duplicate, dropped.
        publish(r, keys, request, 0, 0, token_ids=ids, num_cached_tokens=99, finish_reason="length")

    _, out = run(client, r, keys, CMPL, {"prompt": "x"}, respond)
    assert out["choices"][0]["text"] == " one two"
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
