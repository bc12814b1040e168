"""A Generation (one request as the request layer runs it) against a real Redis, with a test publishing the
worker's events: order, duplicates, gaps, stop strings, characters, samples, errors, timeouts."""

from __future__ import annotations

import time

import pytest

from gateway.serving.errors import APIError
from gateway.serving.generation import GenerationTimeout
from gateway.serving.token_receiver import GenerationError
from gateway.serving.worker_watch import WorkerWatch
from shared.backoff import MAX_DELAY_S
from shared.errors import ErrorCode
from shared.protocol import (
    AbortMessage,
    SampleEnd,
    WireError,
    decode,
    encode,
)
from shared.registry import WorkerRegistry
from tests.support.gateway_app import (
    emit,
    make_generation,
    next_change,
)


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


def test_with_no_live_worker_a_request_fails_after_the_grace_counted_from_redis_coming_back(
    hub, r, keys, tok
) -> None:
    """Redis back after an outage (empty, perhaps): the workers register again once their backoff ends, so
    the grace runs from then; otherwise it runs from when the watch last saw a worker."""
    grace = 0.3
    watch = WorkerWatch(WorkerRegistry(r, keys), refresh_s=0.05)  # no worker registered under this prefix
    hub.back_at = time.monotonic()  # the hub's connection just came back
    gen = make_generation(hub, r, keys, tok, timeout_s=30, watch=watch, no_worker_grace_s=grace)
    started = time.monotonic()
    while time.monotonic() - started < 2 * grace:
        gen.step(0.05)
    assert gen.aborted is None
    hub.back_at = time.monotonic() - MAX_DELAY_S  # back long enough for every worker to have tried again
    with pytest.raises(GenerationError) as info:
        while time.monotonic() - started < 5:
            gen.step(0.05)
    gen.close()
    assert info.value.code is ErrorCode.NO_WORKER
    assert r.get(keys.abort_flag(gen.request_id)) == "error"
