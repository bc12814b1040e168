"""The scheduler service against a real Redis: the tests play the gateway and the workers."""

from __future__ import annotations

import threading
import time
from typing import cast

import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.admission import Admit, WorkerRoom, plan_admissions
from scheduler_svc.failover import resume_request
from scheduler_svc.queue import QueuedRequest, WaitingQueue
from scheduler_svc.reserve import Reserver
from scheduler_svc.service import SchedulerService
from shared.errors import ErrorCode
from shared.keys import Keys
from shared.protocol import (
    Assignment,
    SampleEnd,
    SchedulerStats,
    TokenEvent,
    decode,
    encode,
)
from shared.records import parse_ends
from tests.support.scheduler_stage import (
    BLOCK_SIZE,
    heartbeat,
    inbox,
    inbox_rids,
    make_request,
    make_service,
    num_pending,
    reserved,
    submit,
    take_in,
)


def test_priority_then_arrival_order(redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys) -> None:
    svc = make_service(redis_url, redis_prefix)
    submit(r, keys, make_request("late-low", priority=1, arrival_time=1.0))
    submit(r, keys, make_request("later-high", priority=0, arrival_time=3.0))
    submit(r, keys, make_request("early-high", priority=0, arrival_time=2.0))
    svc.step()  # no worker yet: everything waits
    assert len(svc.queue) == 3 and num_pending(r, keys) == 3
    heartbeat(r, keys, "w1")
    svc.step()
    assert inbox_rids(r, keys, "w1") == ["early-high", "later-high", "late-low"]


def test_head_of_line_is_not_skipped(redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys) -> None:
    svc = make_service(redis_url, redis_prefix)
    heartbeat(r, keys, "w1", free=6, total=20)  # 4 available above the watermark
    submit(r, keys, make_request("big", num_blocks=5, priority=0))
    submit(r, keys, make_request("small", num_blocks=1, priority=1))
    svc.step()
    assert inbox_rids(r, keys, "w1") == []
    heartbeat(r, keys, "w1", free=7, total=20)  # 5 available: the head goes, the next still waits
    svc.step()
    assert inbox_rids(r, keys, "w1") == ["big"]
    assert [e.request.request_id for e in svc.queue] == ["small"]


def test_admission_counts_reservations_waiting_blocks_and_watermark(
    redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys
) -> None:
    svc = make_service(redis_url, redis_prefix)
    heartbeat(r, keys, "w1", free=10, total=10)  # 10 - watermark 2 = 8 available
    for rid in "abc":
        submit(r, keys, make_request(rid, num_blocks=3))
    svc.step()
    entries = inbox(r, keys, "w1")
    assert [a.request.request_id for _, a in entries] == ["a", "b"]
    assert [a.reserved_blocks for _, a in entries] == [3, 3]
    assert reserved(r, keys, "w1") == 6
    svc.step()  # same heartbeat: both still reserved, so c still waits
    assert inbox_rids(r, keys, "w1") == ["a", "b"] and len(svc.queue) == 1

    # The worker took in "a" only: "b" stays reserved on top of what free_blocks says.
    take_in(r, keys, "w1", 1, free=7)
    svc.step()
    assert reserved(r, keys, "w1") == 3 and len(svc.queue) == 1
    # Both taken in but still queued inside the worker: waiting_blocks keeps them counted.
    take_in(r, keys, "w1", 1, free=10, waiting_blocks=6)
    svc.step()
    assert reserved(r, keys, "w1") == 0 and len(svc.queue) == 1
    heartbeat(r, keys, "w1", free=10, total=10, waiting_blocks=5)
    svc.step()
    assert inbox_rids(r, keys, "w1") == ["c"] and len(svc.queue) == 0


def test_reservations_outlive_a_scheduler_restart(
    redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys
) -> None:
    heartbeat(r, keys, "w1", free=10, total=10)
    svc = make_service(redis_url, redis_prefix)
    submit(r, keys, make_request("a", num_blocks=3))
    submit(r, keys, make_request("b", num_blocks=2))
    svc.step()
    take_in(r, keys, "w1", 1, free=7)
    restarted = make_service(redis_url, redis_prefix, consumer="sched-b")
    restarted.step()
    assert restarted.view.live["w1"].reserved_blocks == 2


def test_two_schedulers_never_promise_a_workers_blocks_twice(
    redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys
) -> None:
    """Two schedulers in one consumer group admit at once against workers that take nothing in, so that
    every admission stays reserved: no worker is promised more than it has, no request goes out twice."""
    capacity = {"w1": 23, "w2": 14, "w3": 9}
    for wid, free in capacity.items():
        heartbeat(r, keys, wid, free=free, total=free)
    schedulers = [make_service(redis_url, redis_prefix, consumer=name) for name in ("sched-a", "sched-b")]
    sizes = [1 + i % 3 for i in range(120)]
    stop = threading.Event()

    def run(svc: SchedulerService) -> None:
        while not stop.is_set():
            svc.step(block_ms=5)

    threads = [threading.Thread(target=run, args=(svc,)) for svc in schedulers]
    for t in threads:
        t.start()
    try:
        for i, size in enumerate(sizes):
            submit(r, keys, make_request(f"r{i}", num_blocks=size))
        time.sleep(1.5)
    finally:
        stop.set()
        for t in threads:
            t.join()
    admitted: list[str] = []
    room_left: list[int] = []
    for wid, free in capacity.items():
        entries = inbox(r, keys, wid)
        blocks = sum(a.reserved_blocks for _, a in entries)
        assert blocks == reserved(r, keys, wid) <= free - 2, wid  # the watermark
        admitted += [a.request.request_id for _, a in entries]
        room_left.append(free - 2 - blocks)
    assert len(admitted) == len(set(admitted))
    queued = {e.request.request_id for svc in schedulers for e in svc.queue}
    assert len(queued & set(admitted)) == 0 and len(queued) + len(admitted) == len(sizes)
    # Neither stopped short: what each has at the head of its queue (admission keeps the order) fits nowhere.
    for svc in schedulers:
        if svc.queue:
            head = next(iter(svc.queue)).request.request_id
            assert sizes[int(head[1:])] > max(room_left), (head, room_left)


def test_least_loaded_routing_spreads_requests(
    redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys
) -> None:
    svc = make_service(redis_url, redis_prefix)
    heartbeat(r, keys, "w1", num_running=3)
    heartbeat(r, keys, "w2")
    for i in range(6):
        submit(r, keys, make_request(f"r{i}", num_blocks=2))
    svc.step()
    # Equal free blocks: the first goes to the worker running fewer sequences, then they alternate.
    assert inbox_rids(r, keys, "w2") == ["r0", "r2", "r4"]
    assert inbox_rids(r, keys, "w1") == ["r1", "r3", "r5"]
    assert r.hlen(keys.assigned("w1")) == 3 and r.hlen(keys.assigned("w2")) == 3


def test_each_model_has_a_queue_of_its_own_and_only_its_workers(
    redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys
) -> None:
    svc = make_service(redis_url, redis_prefix)
    heartbeat(r, keys, "small", free=6, total=10, model="small")  # room for one 4-block prompt
    heartbeat(r, keys, "large", free=100, total=100, model="large")
    for rid, model in [("s1", "small"), ("s2", "small"), ("l1", "large"), ("any", "")]:
        submit(r, keys, make_request(rid, num_blocks=4).model_copy(update={"model": model}))
    svc.step()
    # s2 waits for room on the only worker of its model; the large model's request, behind it in arrival
    # order, is not held up, and a request of no model goes to any worker.
    assert inbox_rids(r, keys, "small") == ["s1"]
    assert inbox_rids(r, keys, "large") == ["l1", "any"]
    stats = SchedulerStats.from_hash(r.hgetall(keys.scheduler_stats))  # type: ignore[arg-type]
    assert stats.waiting_by_model == {"small": 1} and stats.num_waiting == 1
    submit(r, keys, make_request("nobody", num_blocks=1).model_copy(update={"model": "absent"}))
    svc.step()  # a model with no live worker: it waits (the gateway ends it with no_worker after its grace)
    stats = SchedulerStats.from_hash(r.hgetall(keys.scheduler_stats))  # type: ignore[arg-type]
    assert stats.waiting_by_model == {"small": 1, "absent": 1}
    take_in(r, keys, "small", 1, free=2)
    r.hdel(keys.assigned("small"), "s1")  # the worker finished s1 and gave its blocks back
    heartbeat(r, keys, "small", free=6, total=10, model="small")
    svc.step()
    assert inbox_rids(r, keys, "small") == ["s2"] and inbox_rids(r, keys, "large") == ["l1", "any"]


def test_max_running_per_worker(redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys) -> None:
    svc = make_service(redis_url, redis_prefix, max_running_per_worker=1)
    heartbeat(r, keys, "w1")
    submit(r, keys, make_request("a"))
    submit(r, keys, make_request("b"))
    svc.step()
    svc.step()
    assert inbox_rids(r, keys, "w1") == ["a"]
    r.hdel(keys.assigned("w1"), "a")  # the worker finished "a"
    svc.step()
    assert inbox_rids(r, keys, "w1") == ["a", "b"]


def test_a_draining_worker_gets_nothing_new(
    redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys
) -> None:
    svc = make_service(redis_url, redis_prefix)
    heartbeat(r, keys, "w1", draining=True)
    heartbeat(r, keys, "w2", free=10, total=10)
    for rid in "abc":
        submit(r, keys, make_request(rid))
    svc.step()
    svc.step()
    assert inbox_rids(r, keys, "w1") == []
    assert inbox_rids(r, keys, "w2") == ["a", "b", "c"]
    # The admit script itself refuses it, whatever a scheduler's view of the rooms said when it planned.
    reserver = Reserver(r, keys, watermark_blocks=0, max_assigned=10)
    assignment = Assignment(worker_id="w1", request=make_request("d"), reserved_blocks=1)
    pipe = r.pipeline()
    reserver.admit(pipe, assignment, "0-1")
    assert pipe.execute() == [None]
    assert not r.hexists(keys.assigned("w1"), "d")
    heartbeat(r, keys, "w1")  # a new process under the same id
    submit(r, keys, make_request("d"))
    svc.step()
    svc.step()
    assert inbox_rids(r, keys, "w1") == ["d"]


def test_restart_same_consumer_rereads_pending(
    redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys
) -> None:
    first = make_service(redis_url, redis_prefix)
    for rid in "abc":
        submit(r, keys, make_request(rid))
    first.step()
    assert len(first.queue) == 3 and num_pending(r, keys) == 3  # read, not acked: no worker yet
    del first  # killed

    restarted = make_service(redis_url, redis_prefix)
    heartbeat(r, keys, "w1")
    restarted.step()
    assert inbox_rids(r, keys, "w1") == ["a", "b", "c"]
    assert num_pending(r, keys) == 0 and r.xlen(keys.requests) == 0
    restarted.step()
    assert inbox_rids(r, keys, "w1") == ["a", "b", "c"]


def test_new_consumer_claims_a_dead_schedulers_entries_only(
    redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys
) -> None:
    first = make_service(redis_url, redis_prefix, consumer="sched-a", claim_idle_s=0.3)
    second = make_service(redis_url, redis_prefix, consumer="sched-b", claim_idle_s=0.3)
    for rid in "abc":
        submit(r, keys, make_request(rid))
    first.step()
    deadline = time.monotonic() + 0.8
    while time.monotonic() < deadline:  # both alive: the waiting entries stay with the first
        first.step()
        second.step()
        time.sleep(0.02)
    assert len(first.queue) == 3 and len(second.queue) == 0

    del first  # killed: its entries go idle and the second claims them
    deadline = time.monotonic() + 3
    while len(second.queue) < 3 and time.monotonic() < deadline:
        second.step()
        time.sleep(0.02)
    assert len(second.queue) == 3
    heartbeat(r, keys, "w1")
    second.step()
    assert inbox_rids(r, keys, "w1") == ["a", "b", "c"]
    assert num_pending(r, keys) == 0


def test_dead_worker_requests_resume_elsewhere(
    redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys
) -> None:
    svc = make_service(redis_url, redis_prefix)
    heartbeat(r, keys, "w1")
    requests = {
        "multi": make_request("multi", n=3, priority=2, arrival_time=5.0),
        "single": make_request("single", arrival_time=6.0),
        "done": make_request("done", arrival_time=7.0),
        "aborted": make_request("aborted", arrival_time=8.0),
    }
    for request in requests.values():
        submit(r, keys, request)
    svc.step()
    assert sorted(inbox_rids(r, keys, "w1")) == sorted(requests)

    # The worker streamed some tokens, finished a few samples, then died (its heartbeat expired).
    r.rpush(keys.tokens("multi", 0), 5, 6, 7)
    r.rpush(keys.tokens("multi", 1), 8)
    r.hset(keys.finished("multi"), "1", encode(SampleEnd(finish_reason="stop")))
    r.rpush(keys.tokens("single", 0), 9)
    r.rpush(keys.tokens("done", 0), 1, 2)
    r.hset(keys.finished("done"), "0", encode(SampleEnd(finish_reason="length")))
    r.set(keys.abort_flag("aborted"), 1)
    r.delete(keys.worker("w1"))
    heartbeat(r, keys, "w2")

    svc.step()  # sweeps w1: re-queues through the requests stream
    assert not r.exists(keys.inbox("w1"), keys.assigned("w1"))
    assert not r.sismember(keys.workers, "w1")
    svc.step()  # the re-queued requests take the normal path
    resumed = {a.request.request_id: a for _, a in inbox(r, keys, "w2")}
    assert sorted(resumed) == ["multi", "single"]
    multi = resumed["multi"].request
    assert multi.samples == [0, 2] and multi.resume == {0: [5, 6, 7]}
    assert (multi.priority, multi.arrival_time) == (2, 5.0)
    single = resumed["single"].request
    assert single.samples == [0] and single.resume == {0: [9]}
    # The prompt plus the resumed token: 16 + 1 tokens take two blocks.
    assert resumed["single"].reserved_blocks == 2
    assert num_pending(r, keys) == 0


def test_after_a_redis_outage_no_worker_is_declared_dead_for_a_heartbeat_ttl(
    redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys
) -> None:
    """A heartbeat that lapsed while Redis was away (or in a failover) says nothing of its worker: the sweep
    waits a heartbeat TTL from the scheduler's reconnection, then takes a worker that did not beat again."""
    svc = make_service(redis_url, redis_prefix, heartbeat_ttl_s=0.5)
    heartbeat(r, keys, "w1")
    submit(r, keys, make_request("a"))
    svc.step()
    assert inbox_rids(r, keys, "w1") == ["a"]
    svc.redis_lost()
    r.delete(keys.worker("w1"))  # its beats were lost with the outage
    svc.step()
    svc.step()
    assert r.sismember(keys.workers, "w1") and r.hlen(keys.assigned("w1")) == 1
    time.sleep(0.6)
    svc.step()  # no beat within the TTL: dead after all
    assert not r.sismember(keys.workers, "w1") and not r.exists(keys.assigned("w1"))


def test_sweep_waits_for_the_lock_and_spares_a_worker_that_came_back(
    redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys
) -> None:
    svc = make_service(redis_url, redis_prefix)
    heartbeat(r, keys, "w1")
    submit(r, keys, make_request("a"))
    svc.step()
    r.delete(keys.worker("w1"))
    r.set(keys.scheduler_lock, "another-scheduler", px=10_000)
    svc.step()  # another scheduler is sweeping: leave it be
    assert r.sismember(keys.workers, "w1") and r.hlen(keys.assigned("w1")) == 1
    r.delete(keys.scheduler_lock)
    heartbeat(r, keys, "w1")  # it was only slow
    assert svc.failover.sweep(["w1"]) == []
    assert r.hlen(keys.assigned("w1")) == 1 and r.xlen(keys.inbox("w1")) == 1
    r.delete(keys.worker("w1"))
    svc.step()
    assert not r.sismember(keys.workers, "w1") and not r.exists(keys.scheduler_lock)
    svc.step()
    assert [e.request.request_id for e in svc.queue] == ["a"]


def test_resume_request_keeps_the_longest_record() -> None:
    request = make_request("r", n=2).model_copy(update={"samples": [0, 1], "resume": {0: [1, 2, 3]}})
    assert resume_request(request, {0, 1}, {}) is None
    resumed = resume_request(request, {}, {0: [1], 1: [4, 5]})
    assert resumed is not None
    assert resumed.samples == [0, 1] and resumed.resume == {0: [1, 2, 3], 1: [4, 5]}


def test_never_fits_gets_error_events(redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys) -> None:
    svc = make_service(redis_url, redis_prefix)
    heartbeat(r, keys, "w1", free=3, total=10)
    heartbeat(r, keys, "w2", free=3, total=4, max_model_len=64)
    pubsub = r.pubsub()
    pubsub.subscribe(keys.events("huge"), keys.events("long"))
    for _ in range(2):
        message = pubsub.get_message(timeout=1)
        assert message is not None and message["type"] == "subscribe"
    # The head waits for blocks; the hopeless requests behind it are answered at once anyway.
    submit(r, keys, make_request("head", num_blocks=3))
    submit(r, keys, make_request("huge", num_blocks=9, n=2, priority=1))  # more than 10 - 2
    svc.step()
    heartbeat(r, keys, "w1", free=3, total=10, max_model_len=64)
    submit(r, keys, make_request("long", num_blocks=4, priority=1))  # 64 tokens >= every max_model_len
    svc.step()

    events: list[TokenEvent] = []
    deadline = time.monotonic() + 5
    while len(events) < 3 and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.1)
        if message and message["type"] == "message":
            events.append(decode(TokenEvent, message["data"]))
    pubsub.close()
    got = sorted((e.request_id, e.index, e.finish_reason, e.worker_id, e.start) for e in events)
    assert got == [
        ("huge", 0, "error", "scheduler", 0),
        ("huge", 1, "error", "scheduler", 0),
        ("long", 0, "error", "scheduler", 0),
    ]
    assert all(e.error and e.num_prompt_tokens > 0 for e in events)
    errors = {e.request_id: e.error for e in events if e.error is not None}
    huge, long = errors["huge"], errors["long"]
    assert huge.code is ErrorCode.KV_CAPACITY_EXCEEDED and "KV blocks" in huge.message
    assert long.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and "max_model_len" in long.message
    # Recorded as well, for a gateway that misses the event.
    ends = parse_ends(cast(dict[str, str], r.hgetall(keys.finished("huge"))))
    assert ends == {i: SampleEnd(finish_reason="error", error=errors["huge"]) for i in (0, 1)}
    assert [e.request.request_id for e in svc.queue] == ["head"]
    assert num_pending(r, keys) == 1 and inbox_rids(r, keys, "w1") == []


def test_aborted_request_is_dropped(redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys) -> None:
    svc = make_service(redis_url, redis_prefix)
    heartbeat(r, keys, "w1")
    r.set(keys.abort_flag("gone"), 1)
    submit(r, keys, make_request("gone"))
    submit(r, keys, make_request("kept"))
    svc.step()
    assert inbox_rids(r, keys, "w1") == ["kept"]
    assert len(svc.queue) == 0 and num_pending(r, keys) == 0 and r.xlen(keys.requests) == 0


def test_unreadable_entry_is_dropped(redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys) -> None:
    svc = make_service(redis_url, redis_prefix)
    r.xadd(keys.requests, {"data": "not json"})
    svc.step()
    assert len(svc.queue) == 0 and num_pending(r, keys) == 0


def test_stats_hash(redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys) -> None:
    svc = make_service(redis_url, redis_prefix)
    submit(r, keys, make_request("a"))
    submit(r, keys, make_request("b"))
    svc.step()
    stats = SchedulerStats.from_hash(r.hgetall(keys.scheduler_stats))  # type: ignore[arg-type]
    assert (stats.num_waiting, stats.num_assigned) == (2, 0)
    assert 0 < r.pttl(keys.scheduler_stats) <= 5000
    time.sleep(0.02)  # the queue time to come: over 10 ms
    heartbeat(r, keys, "w1")
    svc.step()
    stats = SchedulerStats.from_hash(r.hgetall(keys.scheduler_stats))  # type: ignore[arg-type]
    assert (stats.num_waiting, stats.num_assigned) == (0, 2)
    # Both waited (from their entry to their inbox entry) at least as long as no worker was there.
    assert stats.num_admitted == 2 and stats.queue_time_buckets[-1] == 2 and stats.queue_time_buckets[5] == 0
    assert stats.queue_time_sum_s > 0


def _room(wid: str, available: int, capacity: int = 64) -> WorkerRoom:
    return WorkerRoom(wid, BLOCK_SIZE, available, capacity, 1 << 20, num_assigned=0, load=0)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 8), max_size=12),
    available=st.lists(st.integers(-2, 30), min_size=1, max_size=3),
)
def test_plan_never_overcommits_and_admits_a_prefix(sizes: list[int], available: list[int]) -> None:
    queue = WaitingQueue()
    for i, size in enumerate(sizes):
        queue.push(QueuedRequest(f"1-{i}", make_request(f"r{i}", num_blocks=size, arrival_time=float(i))))
    rooms = [_room(f"w{j}", a) for j, a in enumerate(available)]
    decisions = plan_admissions(queue, rooms, max_running=256)
    assert [d.entry.request.request_id for d in decisions] == [f"r{i}" for i in range(len(decisions))]
    assert all(isinstance(d, Admit) for d in decisions)
    for j, a in enumerate(available):
        used = sum(d.reserved_blocks for d in decisions if isinstance(d, Admit) and d.worker_id == f"w{j}")
        assert used <= max(a, 0)
    if len(decisions) < len(sizes):  # the next one fits nowhere in what is left
        assert all(sizes[len(decisions)] > room.available_blocks for room in rooms)
