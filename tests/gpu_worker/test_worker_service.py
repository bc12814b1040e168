"""The worker service on a real Redis: inbox in, token events and records out, aborts, failover resume."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from gpu_worker import LLM, SamplingParams
from gpu_worker.engine.speculative import NgramIndex, SpecState
from gpu_worker.service import WorkerService
from gpu_worker.settings import WorkerSettings
from scheduler_svc.queue import QueuedRequest
from shared import streams
from shared.errors import ErrorCode
from shared.keys import Keys
from shared.kv_events import KVEvent
from shared.prefix import block_hashes
from shared.protocol import (
    AbortMessage,
    Assignment,
    GenerateRequest,
    Heartbeat,
    SampleEnd,
    TokenEvent,
    decode,
    encode,
)
from shared.sampling import SamplingSpec

PROMPT = [5, 17, 230, 4000, 77, 12, 9, 301, 45, 46, 47, 48, 1000, 2000, 3000, 4000, 5000, 6000]


@pytest.fixture
def worker(tiny_model_path: str, redis_url: str, redis_prefix: str, offline: LLM) -> Iterator[WorkerService]:
    settings = WorkerSettings(
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        model=tiny_model_path,
        dtype="float32",  # as the offline run, token for token
        worker_id="w1",
        num_kv_blocks=64,
    )
    service = WorkerService(settings)
    service.register()
    yield service
    service.aborts.close()
    stats = service.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert not service.active and not service.engine.requests


def greedy(offline: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return offline.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def assign(client: redis.Redis, keys: Keys, request: GenerateRequest, wid: str = "w1") -> None:
    assignment = Assignment(worker_id=wid, request=request, reserved_blocks=2)
    pipe = client.pipeline()
    pipe.xadd(keys.inbox(wid), streams.inbox_entry(assignment))  # type: ignore[arg-type]
    pipe.hset(keys.assigned(wid), request.request_id, encode(assignment))
    pipe.execute()


def collect(worker: WorkerService, pubsub: redis.client.PubSub, num_samples: int) -> list[TokenEvent]:
    """Step the worker until every sample has a final event; return the events in order."""
    events: list[TokenEvent] = []
    finished: set[int] = set()
    deadline = time.monotonic() + 30
    while len(finished) < num_samples and time.monotonic() < deadline:
        worker.run_once()
        while (message := pubsub.get_message(timeout=0.01)) is not None:
            if message["type"] == "message":
                event = decode(TokenEvent, message["data"])
                events.append(event)
                if event.finish_reason is not None:
                    finished.add(event.index)
    assert len(finished) == num_samples, "the worker did not finish in time"
    return events


def subscribe(client: redis.Redis, keys: Keys, rid: str) -> redis.client.PubSub:
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.events(rid))
    return pubsub


def request(rid: str, **sampling: object) -> GenerateRequest:
    spec = SamplingSpec(**{"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, **sampling})  # type: ignore[arg-type]
    return GenerateRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=spec, arrival_time=time.time())


def test_tokens_streamed_recorded_and_equal_to_offline(worker: WorkerService, offline: LLM) -> None:
    client, keys = worker.redis, worker.keys
    pubsub = subscribe(client, keys, "r1")
    assign(client, keys, request("r1", logprobs=2))
    events = collect(worker, pubsub, 1)
    tokens = [t for e in events for t in e.token_ids]
    assert tokens == greedy(offline, PROMPT, 12)
    assert [e.start for e in events] == list(range(12))
    assert events[-1].finish_reason == "length"
    assert all(e.logprobs and len(e.logprobs[0].top) == 2 for e in events)
    assert [int(t) for t in client.lrange(keys.tokens("r1", 0), 0, -1)] == tokens
    assert decode(SampleEnd, client.hget(keys.finished("r1"), "0")) == SampleEnd(finish_reason="length")
    assert not client.hexists(keys.assigned("w1"), "r1")
    # The inbox entry was acknowledged and deleted, and the heartbeat says the engine took it.
    assert client.xpending(keys.inbox("w1"), "worker")["pending"] == 0
    assert client.xlen(keys.inbox("w1")) == 0
    worker.heartbeat()
    beat = Heartbeat.from_hash(client.hgetall(keys.worker("w1")))
    assert beat.free_blocks == beat.total_blocks == 64
    assert beat.prompt_tokens_total == len(PROMPT) and beat.generation_tokens_total == 12


def test_parallel_samples_each_stream_from_zero(worker: WorkerService) -> None:
    client, keys = worker.redis, worker.keys
    pubsub = subscribe(client, keys, "r2")
    assign(client, keys, request("r2", n=2, temperature=1.0, seed=3))
    events = collect(worker, pubsub, 2)
    for index in (0, 1):
        mine = [e for e in events if e.index == index]
        assert [e.start for e in mine] == list(range(12))
        assert mine[-1].finish_reason == "length"


def test_resumed_sample_continues_where_it_stopped(worker: WorkerService, offline: LLM) -> None:
    client, keys = worker.redis, worker.keys
    full = greedy(offline, PROMPT, 12)
    resumed = request("r3").model_copy(update={"samples": [0], "resume": {0: full[:5]}})
    pubsub = subscribe(client, keys, "r3")
    assign(client, keys, resumed)
    events = collect(worker, pubsub, 1)
    assert events[0].start == 5
    assert [t for e in events for t in e.token_ids] == full[5:]


def test_abort_stops_the_request_and_frees_blocks(worker: WorkerService) -> None:
    client, keys = worker.redis, worker.keys
    pubsub = subscribe(client, keys, "r4")
    assign(client, keys, request("r4", max_tokens=500))
    for _ in range(4):
        worker.run_once()
    assert worker.engine.stats().num_free_blocks < 64
    client.publish(keys.aborts, encode(AbortMessage(request_id="r4", reason="client_disconnect")))
    events = collect(worker, pubsub, 1)
    assert events[-1].finish_reason == "abort"
    assert worker.engine.stats().num_free_blocks == 64


def test_request_that_cannot_fit_gets_an_error_event(worker: WorkerService) -> None:
    client, keys = worker.redis, worker.keys
    pubsub = subscribe(client, keys, "r5")
    assign(client, keys, request("r5", max_tokens=64 * 16))
    events = collect(worker, pubsub, 1)
    error = events[-1].error
    assert events[-1].finish_reason == "error" and error is not None
    assert error.code is ErrorCode.KV_CAPACITY_EXCEEDED and "KV pool" in error.message
    # Recorded too, for a gateway that missed the event.
    assert decode(SampleEnd, client.hget(keys.finished("r5"), "0")).error == error
    assert not client.hexists(keys.assigned("w1"), "r5")


def inbox_entry(rid: str, **extra: object) -> str:
    """An assignment as JSON, with fields it should not have."""
    data = json.loads(encode(Assignment(worker_id="w1", request=request(rid, n=2), reserved_blocks=2)))
    for path, value in extra.items():
        *parents, name = path.split("__")
        target = data
        for parent in parents:
            target = target[parent]
        target[name] = value
    return json.dumps(data)


@pytest.mark.parametrize(
    "extra",
    [
        {"priority_class": "gold"},  # unknown at the top
        {"request__sampling__beam_width": 4},  # unknown inside the sampling spec
        {"request__sampling__temperature": "hot"},  # of the wrong type
        {"v": 99},  # another protocol version
    ],
)
def test_an_unreadable_assignment_is_answered_with_an_error_and_the_worker_goes_on(
    worker: WorkerService, extra: dict[str, object]
) -> None:
    client, keys = worker.redis, worker.keys
    pubsub = subscribe(client, keys, "bad")
    client.xadd(keys.inbox("w1"), {"data": inbox_entry("bad", **extra)})
    client.hset(keys.assigned("w1"), "bad", "{}")
    client.xadd(keys.inbox("w1"), {"nothing": "here"})  # no data at all: nobody to answer, only dropped
    events = collect(worker, pubsub, 2)
    assert [(e.index, e.finish_reason) for e in events] == [(0, "error"), (1, "error")]
    assert all(e.error is not None and e.error.code is ErrorCode.PROTOCOL_ERROR for e in events)
    assert not client.hexists(keys.assigned("w1"), "bad")
    assert client.xpending(keys.inbox("w1"), "worker")["pending"] == 0
    # The next request runs as usual.
    pubsub = subscribe(client, keys, "good")
    assign(client, keys, request("good"))
    assert collect(worker, pubsub, 1)[-1].finish_reason == "length"


def test_sampling_values_out_of_range_are_an_error_event(worker: WorkerService) -> None:
    client, keys = worker.redis, worker.keys
    pubsub = subscribe(client, keys, "r10")
    # No gateway sends it (the spec refuses it): the worker reads no such assignment, answers it, goes on.
    spec = SamplingSpec.model_construct(top_p=7.0, max_tokens=12)
    bad = GenerateRequest(request_id="r10", prompt_token_ids=PROMPT, sampling=spec, arrival_time=time.time())
    assign(client, keys, bad)
    error = collect(worker, pubsub, 1)[-1].error
    assert error is not None and error.code is ErrorCode.PROTOCOL_ERROR and "top_p" in error.message
    after = subscribe(client, keys, "r11")
    assign(client, keys, request("r11"))
    assert collect(worker, after, 1)[-1].finish_reason == "length"


def test_assignment_of_an_aborted_request_is_dropped(worker: WorkerService) -> None:
    client, keys = worker.redis, worker.keys
    client.set(keys.abort_flag("r6"), 1, ex=60)
    assign(client, keys, request("r6"))
    worker.run_once()
    assert not worker.active
    assert not client.hexists(keys.assigned("w1"), "r6")
    assert client.xpending(keys.inbox("w1"), "worker")["pending"] == 0


def test_heartbeat_outlives_a_step_longer_than_its_ttl(
    worker: WorkerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long step (a big CPU prefill) must not read as a dead worker: the keep-alive extends the TTL."""
    client, keys = worker.redis, worker.keys
    worker.settings = worker.settings.model_copy(update={"heartbeat_ttl_s": 1.0, "heartbeat_interval_s": 0.2})
    worker.heartbeat()
    step = worker.engine.step
    alive_after_step: list[bool] = []

    def slow_step() -> list:  # type: ignore[type-arg]
        time.sleep(2.5)
        alive_after_step.append(bool(client.exists(keys.worker("w1"))))
        return step()

    monkeypatch.setattr(worker.engine, "step", slow_step)
    keeper = threading.Thread(target=worker.keep_alive, daemon=True)
    keeper.start()
    try:
        assign(client, keys, request("r7", max_tokens=1))
        worker.run_once()
    finally:
        worker._keep_alive_stop.set()
        keeper.join()
    assert alive_after_step == [True], "the heartbeat lapsed during the step"
    assert not worker.active
    # Without the loop's own heartbeats and the thread, the key then expires as before.
    time.sleep(1.5)
    assert not client.exists(keys.worker("w1"))


def test_worker_declared_dead_drops_its_requests_and_rejoins(worker: WorkerService) -> None:
    """What failover does to a worker the scheduler took for dead; the worker carries on, not crash."""
    client, keys = worker.redis, worker.keys
    assign(client, keys, request("r8", max_tokens=500))
    worker.run_once()
    assert worker.active
    client.delete(keys.inbox("w1"), keys.assigned("w1"), keys.worker("w1"))
    client.srem(keys.workers, "w1")
    worker.run_once()
    assert not worker.active and not worker.engine.requests
    assert client.sismember(keys.workers, "w1") and client.exists(keys.worker("w1"))
    # And it takes new work again.
    pubsub = subscribe(client, keys, "r9")
    assign(client, keys, request("r9"))
    assert collect(worker, pubsub, 1)[-1].finish_reason == "length"


def test_after_lost_writes_the_assigned_hash_keeps_only_what_runs_or_waits_unread(
    worker: WorkerService,
) -> None:
    """A failover lost the end of a request (its HDEL with it) and the assignment of one running here: the
    first leaves the hash, as its place on this worker would be taken for ever; the second is dropped, as
    the scheduler assigns it again; what runs and what waits unread in the inbox stay."""
    client, keys = worker.redis, worker.keys
    for rid in ("runs", "unassigned"):
        assign(client, keys, request(rid, max_tokens=500))
    worker.run_once()
    assert set(worker.active) == {"runs", "unassigned"}
    client.hdel(keys.assigned("w1"), "unassigned")
    ended = Assignment(worker_id="w1", request=request("ended"), reserved_blocks=2)
    client.hset(keys.assigned("w1"), "ended", encode(ended))
    assign(client, keys, request("unread"))
    worker.register()  # as after a Redis error, with the inbox still there
    assert set(client.hkeys(keys.assigned("w1"))) == {"runs", "unread"}
    assert set(worker.active) == {"runs"}
    for rid in ("runs", "unread"):
        client.publish(keys.aborts, encode(AbortMessage(request_id=rid)))
        client.set(keys.abort_flag(rid), 1, ex=60)
    for _ in range(3):
        worker.run_once()
    assert not worker.active and not client.hkeys(keys.assigned("w1"))


def beat_of(worker: WorkerService) -> Heartbeat:
    worker.heartbeat()
    return Heartbeat.from_hash(worker.redis.hgetall(worker.keys.worker("w1")))  # type: ignore[arg-type]


def test_first_events_carry_cached_tokens_and_last_events_timings_and_heartbeat_counts_exactly(
    worker: WorkerService,
) -> None:
    client, keys = worker.redis, worker.keys
    before = beat_of(worker)
    assert (before.dtype, before.device) == ("float32", "cpu")
    cached = []
    for rid in ("c1", "c2", "c3"):  # one after the other: each alone in its steps
        pubsub = subscribe(client, keys, rid)
        assign(client, keys, request(rid))
        events = collect(worker, pubsub, 1)
        assert events[0].start == 0 and all(e.num_cached_tokens is None for e in events[1:])
        cached.append(events[0].num_cached_tokens)
        assert all(e.timings is None for e in events[:-1]) and all(e.prompt_logprobs is None for e in events)
        timings = events[-1].timings
        assert timings is not None and min(timings.queued_s, timings.prefill_s) >= 0 and timings.decode_s > 0
    assert cached == [0, 16, 16]  # 18 prompt tokens: one full block is shared, the last token is computed
    after = beat_of(worker)
    assert after.prefix_cache_queries_total - before.prefix_cache_queries_total == 3 * len(PROMPT)
    assert after.prefix_cache_hits_total - before.prefix_cache_hits_total == 32
    # Prompt tokens computed (the cached ones are not) plus tokens sampled.
    assert after.iteration_tokens_sum - before.iteration_tokens_sum == 3 * (len(PROMPT) + 12) - 32
    deltas = [a - b for a, b in zip(after.iteration_tokens_buckets, before.iteration_tokens_buckets)]
    # Per request: one step of 18 prompt tokens + 1 sampled (fewer once 16 are cached), then 11 of one token.
    assert deltas[0] == 3 * 11 and deltas[-1] == 3 * 12


def test_first_events_of_every_sample_carry_the_prompt_logprobs(worker: WorkerService, offline: LLM) -> None:
    client, keys = worker.redis, worker.keys
    pubsub = subscribe(client, keys, "pl")
    assign(client, keys, request("pl", n=2, temperature=1.0, seed=4, prompt_logprobs=2))
    events = collect(worker, pubsub, 2)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=2)
    expected = offline.generate([PROMPT], params, use_tqdm=False)[0].prompt_logprobs
    assert expected is not None
    for index in (0, 1):
        first, *rest = [e for e in events if e.index == index]
        assert first.start == 0 and all(e.prompt_logprobs is None for e in rest)
        assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(PROMPT)
        assert first.prompt_logprobs[0] is None and first.num_cached_tokens == 0
        for token, entry, want in zip(PROMPT[1:], first.prompt_logprobs[1:], expected[1:]):
            assert entry is not None and want is not None and entry.token_id == token
            assert len(entry.top) == 2
            assert {token: entry.logprob, **entry.top} == pytest.approx(want, abs=1e-4)


def test_a_resumed_sample_asking_for_prompt_logprobs_continues_unchanged(
    worker: WorkerService, offline: LLM
) -> None:
    client, keys = worker.redis, worker.keys
    full = greedy(offline, PROMPT, 12)
    resumed = request("plr", prompt_logprobs=1).model_copy(update={"samples": [0], "resume": {0: full[:5]}})
    pubsub = subscribe(client, keys, "plr")
    assign(client, keys, resumed)
    events = collect(worker, pubsub, 1)
    assert events[0].start == 5 and all(
        e.prompt_logprobs is None and e.num_cached_tokens is None for e in events
    )
    assert [t for e in events for t in e.token_ids] == full[5:]
    assert events[-1].timings is not None


def test_logit_bias_and_allowed_token_ids_reach_the_sampler(worker: WorkerService) -> None:
    client, keys = worker.redis, worker.keys
    pubsub = subscribe(client, keys, "lb")
    assign(
        client,
        keys,
        request("lb", n=2, temperature=1.0, seed=2, allowed_token_ids=[50, 51], logit_bias={51: 5.0}),
    )
    events = collect(worker, pubsub, 2)
    assert {t for e in events for t in e.token_ids} <= {50, 51}
    pubsub = subscribe(client, keys, "oov")
    assign(client, keys, request("oov", logit_bias={10**7: 1.0}))
    error = collect(worker, pubsub, 1)[-1].error
    assert error is not None and error.code is ErrorCode.INVALID_REQUEST and "logit_bias" in error.message


def test_sigterm_drains_finishing_what_the_worker_holds_then_stops(
    worker: WorkerService, offline: LLM
) -> None:
    client, keys = worker.redis, worker.keys
    subs = {rid: subscribe(client, keys, rid) for rid in ("d1", "d2")}
    assign(client, keys, request("d1", max_tokens=30))
    worker.run_once()
    worker._on_signal(signal.SIGTERM, None)
    # Admitted before any heartbeat said "draining": still this worker's to serve.
    assign(client, keys, request("d2", max_tokens=30))
    assert not worker.stopping
    assert beat_of(worker).draining
    events = {rid: collect(worker, pubsub, 1) for rid, pubsub in subs.items()}
    for rid, got in events.items():
        assert [t for e in got for t in e.token_ids] == greedy(offline, PROMPT, 30), rid
        assert got[-1].finish_reason == "length" and got[-1].error is None
    deadline = time.monotonic() + 5
    while not worker.stopping and time.monotonic() < deadline:
        worker.run_once()
    assert worker.stopping and not worker.active


def test_a_drain_that_outlasts_its_timeout_stops_and_leaves_the_rest_to_other_workers(
    worker: WorkerService,
) -> None:
    client, keys = worker.redis, worker.keys
    worker.settings.drain_timeout_s = 0.3
    pubsub = subscribe(client, keys, "d3")
    assign(client, keys, request("d3", max_tokens=900))
    worker.run_once()
    worker.drain()
    started = time.monotonic()
    while not worker.stopping:
        worker.run_once()
        assert time.monotonic() - started < 5, "the drain did not time out"
    assert time.monotonic() - started >= 0.3
    # Nothing ended it: it stays in the assigned hash, where failover finds it once the heartbeat is gone.
    finals = []
    while (message := pubsub.get_message(timeout=0.01)) is not None:
        if message["type"] == "message":
            finals += [e for e in [decode(TokenEvent, message["data"])] if e.finish_reason or e.error]
    assert finals == []
    assert client.hexists(keys.assigned("w1"), "d3")
    worker.table.abort("d3")  # the fixture's teardown wants a drained engine
    worker.run_once()


def test_without_a_drain_timeout_sigterm_stops_at_once(worker: WorkerService) -> None:
    worker.settings.drain_timeout_s = 0
    worker._on_signal(signal.SIGTERM, None)
    assert worker.stopping
    worker.stopping = False
    worker.settings.drain_timeout_s = 30
    worker._on_signal(signal.SIGINT, None)
    assert worker.stopping


def test_kv_events_tell_what_the_prefix_cache_holds_with_the_schedulers_hashes(worker: WorkerService) -> None:
    client, keys = worker.redis, worker.keys
    pubsub = subscribe(client, keys, "kv")
    assign(client, keys, request("kv", max_tokens=40))
    events = collect(worker, pubsub, 1)
    output = [t for e in events for t in e.token_ids]
    block_size = worker.engine.allocator.block_size
    # The blocks it cached (prompt and output) are those shared.prefix names, as the set and events say.
    expected = set(block_hashes(PROMPT + output, block_size, end_block=(len(PROMPT) + 39) // block_size))
    assert len(expected) == 3
    assert set(worker.engine.allocator.cached_hashes()) == expected
    assert {int(h) for h in client.smembers(keys.kv_blocks("w1"))} == expected
    entries = [KVEvent.read(fields) for _, fields in client.xrange(keys.kv_events("w1"))]
    assert entries[0].reset and [e.seq for e in entries] == list(range(1, len(entries) + 1))
    assert {h for e in entries for h in e.stored} == expected and not any(e.removed for e in entries)
    # What the scheduler matches a prompt with: the prompt's own full block.
    again = QueuedRequest("1-1", request("again"))
    assert again.prompt_hashes(block_size) == block_hashes(PROMPT, block_size)


def test_kv_events_name_evicted_blocks_and_a_rejoin_rewrites_the_set(worker: WorkerService) -> None:
    client, keys = worker.redis, worker.keys
    allocator = worker.engine.allocator
    for i in range(8):  # 96 blocks of distinct prompts in a pool of 64: the oldest are evicted
        rid = f"ev{i}"
        pubsub = subscribe(client, keys, rid)
        prompt = [(7 * i + j) % 4000 + 1 for j in range(12 * allocator.block_size)]
        assign(client, keys, request(rid, max_tokens=1).model_copy(update={"prompt_token_ids": prompt}))
        collect(worker, pubsub, 1)
    assert allocator.num_evictions > 0
    entries = [KVEvent.read(fields) for _, fields in client.xrange(keys.kv_events("w1"))]
    assert any(e.removed for e in entries)
    held = {int(h) for h in client.smembers(keys.kv_blocks("w1"))}
    assert held == set(allocator.cached_hashes())
    client.delete(keys.kv_blocks("w1"))  # as from a Redis that lost it
    worker.register()
    assert {int(h) for h in client.smembers(keys.kv_blocks("w1"))} == held
    last = KVEvent.read(client.xrevrange(keys.kv_events("w1"), count=1)[0][1])
    assert last.reset and last.seq == entries[-1].seq + 1


def test_a_step_that_accepts_drafts_streams_them_in_one_event(
    tiny_model_path: str, redis_url: str, redis_prefix: str, offline: LLM
) -> None:
    """With speculation on, drafts that the model accepts arrive as one event of several tokens, at their
    positions; the record, the heartbeat's counters and the text are those of the plain run."""
    settings = WorkerSettings(
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        model=tiny_model_path,
        dtype="float32",
        worker_id="w1",
        num_kv_blocks=64,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    service = WorkerService(settings)
    service.register()
    expected = greedy(offline, PROMPT, 12)
    speculator = service.engine.step_scheduler.speculator
    assert speculator is not None

    def propose(state: SpecState | None, token_ids: list[int], limit: int) -> tuple[SpecState, list[int]]:
        # The plain run's next tokens, the third of them wrong: a rejection follows two acceptances.
        done = len(token_ids) - len(PROMPT)
        drafts = expected[done : done + min(limit, 3)]
        return state or SpecState(NgramIndex(1, 1)), [*drafts[:2], *(t + 1 for t in drafts[2:])]

    speculator.propose = propose  # type: ignore[method-assign]
    try:
        client, keys = service.redis, service.keys
        pubsub = subscribe(client, keys, "r1")
        assign(client, keys, request("r1", logprobs=1))
        events = collect(service, pubsub, 1)
        tokens = [t for e in events for t in e.token_ids]
        assert tokens == expected
        assert max(len(e.token_ids) for e in events) == 3  # two drafts accepted and the token at the third
        assert [e.start for e in events] == [
            sum(len(x.token_ids) for x in events[:i]) for i in range(len(events))
        ]
        assert all(len(e.logprobs or []) == len(e.token_ids) for e in events)
        assert [int(t) for t in client.lrange(keys.tokens("r1", 0), 0, -1)] == tokens
        service.heartbeat()
        beat = Heartbeat.from_hash(client.hgetall(keys.worker("w1")))
        assert beat.generation_tokens_total == 12 and beat.spec_decode_num_accepted_tokens > 0
        assert (
            beat.spec_decode_num_accepted_tokens_per_pos[2]
            == 0
            < beat.spec_decode_num_accepted_tokens_per_pos[1]
        )
    finally:
        service.aborts.close()
    assert service.engine.stats().num_free_blocks == 64
