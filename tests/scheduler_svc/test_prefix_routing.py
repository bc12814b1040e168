"""Routing by prefix: the index the scheduler keeps from the workers' KV events (on a real Redis, written by
the worker's own publisher over a real block allocator), and the admission that weighs it against load."""

from __future__ import annotations

import random
from collections.abc import Callable

import redis

from gpu_worker.engine.block_allocator import BlockAllocator
from gpu_worker.kv_publisher import KVPublisher
from scheduler_svc.admission import (
    LOAD_RATIO,
    LOAD_SLACK,
    MAX_SCORED_HOLDERS,
    PREFIX_WEIGHT,
    Admit,
    WorkerRoom,
    plan_admissions,
)
from scheduler_svc.failover import Failover
from scheduler_svc.prefix_index import KVEventReader, PrefixIndex
from scheduler_svc.queue import QueuedRequest, WaitingQueue
from shared.keys import Keys
from shared.prefix import block_hashes
from shared.protocol import GenerateRequest, SchedulerStats
from shared.sampling import SamplingSpec
from tests.support.scheduler_stage import BLOCK_SIZE, heartbeat, inbox, make_service, reserved, submit

PREFIX = list(range(1000, 1000 + 8 * BLOCK_SIZE))  # eight blocks every request of a conversation shares


def prompt_of(prefix: list[int], suffix_tokens: int = 20, salt: int = 0) -> list[int]:
    return prefix + [3000 + salt + i for i in range(suffix_tokens)]


def conversation(rid: str, prefix: list[int] = PREFIX, salt: int = 0) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt_of(prefix, salt=salt),
        sampling=SamplingSpec(max_tokens=4),
        arrival_time=0.0,
    )


class StagedWorker:
    """A worker's prefix cache as its KV events tell it: a real allocator and the worker's own publisher."""

    def __init__(self, r: redis.Redis, keys: Keys, wid: str, num_blocks: int = 64) -> None:
        self.allocator = BlockAllocator(num_blocks, BLOCK_SIZE)
        self.publisher = KVPublisher(r, keys, wid, self.allocator)
        self.publisher.publish()  # the registration's rewrite

    def cache(self, tokens: list[int]) -> None:
        """Compute tokens into fresh blocks, cache their full blocks, finish (the blocks stay evictable)."""
        table = self.allocator.allocate(-(-len(tokens) // BLOCK_SIZE))
        self.allocator.cache_full_blocks(table, tokens, 0, len(tokens) // BLOCK_SIZE, None)
        self.allocator.free(table)
        self.publisher.publish()


# -- the index ----------------------------------------------------------------------------------------


def test_index_matches_the_consecutive_run_from_the_start() -> None:
    index = PrefixIndex()
    hashes = block_hashes(PREFIX, BLOCK_SIZE)
    index.store("w1", hashes[:5])
    index.store("w2", hashes[:2] + hashes[3:])  # a hole at block 2: only the first two count
    index.store("w3", hashes[1:])  # no first block: nothing counts
    assert index.matches(hashes) == {"w1": 5, "w2": 2}
    index.drop("w1")
    assert index.matches(hashes) == {"w2": 2} and index.num_held("w1") == 0
    index.remove("w2", hashes[:1])
    assert index.matches(hashes) == {}
    index.drop("w2")
    index.drop("w3")
    assert len(index) == 0


def test_reader_follows_stores_and_evictions(r: redis.Redis, keys: Keys) -> None:
    worker = StagedWorker(r, keys, "w1", num_blocks=16)
    reader = KVEventReader(r, keys)
    reader.update(["w1"])
    worker.cache(prompt_of(PREFIX))  # 9 full blocks
    hashes = block_hashes(prompt_of(PREFIX), BLOCK_SIZE)
    reader.update(["w1"])
    assert reader.index.matches(hashes) == {"w1": 9}
    other = list(range(5000, 5000 + 12 * BLOCK_SIZE))
    worker.cache(other)  # 12 more blocks in a pool of 16: five of the prefix's are evicted
    reader.update(["w1"])
    # Freed tail first, so evicted tail first: the prefix's first four blocks are still there.
    assert reader.index.matches(hashes) == {"w1": 4}
    assert reader.index.matches(block_hashes(other, BLOCK_SIZE)) == {"w1": 12}
    assert reader.index.num_held("w1") == len(worker.allocator.cached_hashes()) == 16
    assert reader.num_resyncs == 1 and reader.num_events == 2


def test_a_gap_in_the_events_is_repaired_by_a_resync(r: redis.Redis, keys: Keys) -> None:
    worker = StagedWorker(r, keys, "w1")
    reader = KVEventReader(r, keys)
    reader.update(["w1"])
    worker.cache(prompt_of(PREFIX, salt=1))
    worker.cache(prompt_of(PREFIX, salt=2))
    # Entries the reader never read are trimmed away (as a capped stream does to a reader far behind).
    r.xtrim(keys.kv_events("w1"), maxlen=1, approximate=False)
    reader.update(["w1"])
    assert reader.num_resyncs == 2
    assert reader.index.num_held("w1") == len(worker.allocator.cached_hashes())
    assert reader.index.matches(block_hashes(prompt_of(PREFIX, salt=1), BLOCK_SIZE)) == {"w1": 9}
    worker.cache(list(range(7000, 7000 + 2 * BLOCK_SIZE)))  # and it follows on from there
    reader.update(["w1"])
    assert reader.num_resyncs == 2 and reader.index.num_held("w1") == len(worker.allocator.cached_hashes())


def test_a_worker_that_starts_again_under_its_id_is_reloaded(r: redis.Redis, keys: Keys) -> None:
    StagedWorker(r, keys, "w1").cache(prompt_of(PREFIX))
    reader = KVEventReader(r, keys)
    reader.update(["w1"])
    assert reader.index.num_held("w1") == 9
    StagedWorker(r, keys, "w1")  # an empty cache, numbered from 1 again
    reader.update(["w1"])
    assert reader.index.num_held("w1") == 0 and reader.num_resyncs == 2


def test_a_dead_worker_leaves_the_index_and_its_keys_go(r: redis.Redis, keys: Keys) -> None:
    StagedWorker(r, keys, "w1").cache(prompt_of(PREFIX))
    StagedWorker(r, keys, "w2").cache(prompt_of(PREFIX))
    reader = KVEventReader(r, keys)
    reader.update(["w1", "w2"])
    hashes = block_hashes(prompt_of(PREFIX), BLOCK_SIZE)
    assert reader.index.matches(hashes) == {"w1": 9, "w2": 9}
    r.sadd(keys.workers, "w1")  # registered, with no heartbeat: dead
    Failover(r, keys, owner="test").sweep(["w1"])
    assert not r.exists(keys.kv_blocks("w1"), keys.kv_events("w1"))
    reader.update(["w2"])
    assert reader.index.matches(hashes) == {"w2": 9} and reader.index.workers() == ["w2"]


# -- admission ----------------------------------------------------------------------------------------


def room(
    wid: str, available: int, num_assigned: int = 0, recent: float = 0.0, draining: bool = False
) -> WorkerRoom:
    return WorkerRoom(
        wid,
        BLOCK_SIZE,
        available,
        1000,
        1 << 20,
        num_assigned=num_assigned,
        load=num_assigned,
        recent_assigned=recent,
        draining=draining,
    )


def queue_of(requests: list[GenerateRequest]) -> WaitingQueue:
    queue = WaitingQueue()
    for i, request in enumerate(requests):
        queue.push(QueuedRequest(f"1-{i}", request.model_copy(update={"arrival_time": float(i)})))
    return queue


def test_a_request_goes_where_its_prefix_is_and_reserves_only_what_is_computed_there() -> None:
    index = PrefixIndex()
    index.store("w2", block_hashes(PREFIX, BLOCK_SIZE))

    def matcher(entry: QueuedRequest, block_size: int) -> dict[str, int]:
        return index.matches(entry.prompt_hashes(block_size))

    rooms = [room("w1", 100), room("w2", 60)]  # w1 has far more room
    (admit,) = plan_admissions(queue_of([conversation("a")]), rooms, 256, matcher)
    assert isinstance(admit, Admit)
    # 10 blocks (148 tokens), w2 holds 8: 2 to compute there. Scores 2 x 8/10 + 60/1000 and 100/1000.
    assert (admit.worker_id, admit.reserved_blocks, admit.prompt_blocks, admit.matched_blocks) == (
        "w2",
        2,
        10,
        8,
    )
    assert (admit.runner_up, round(admit.score, 6), round(admit.runner_up_score, 6)) == ("w1", 1.66, 0.1)
    # By load alone it goes to the freest worker, reserving every block.
    (by_load,) = plan_admissions(queue_of([conversation("a")]), [room("w1", 100), room("w2", 60)], 256)
    assert isinstance(by_load, Admit) and (by_load.worker_id, by_load.reserved_blocks) == ("w1", 10)


def test_a_prefix_every_request_shares_spreads_over_the_workers() -> None:
    index = PrefixIndex()
    index.store("w1", block_hashes(PREFIX, BLOCK_SIZE))  # only w1 has seen it so far
    held: set[str] = {"w1"}

    def matcher(entry: QueuedRequest, block_size: int) -> dict[str, int]:
        return index.matches(entry.prompt_hashes(block_size))

    rooms = [room("w1", 500), room("w2", 500)]
    requests = [conversation(f"r{i}", salt=i) for i in range(40)]
    chosen = []
    for request in requests:  # one at a time: a worker that computed the prefix holds it from then on
        (admit,) = plan_admissions(queue_of([request]), rooms, 256, matcher)
        assert isinstance(admit, Admit)
        chosen.append(admit.worker_id)
        if admit.worker_id not in held:
            index.store(admit.worker_id, block_hashes(PREFIX, BLOCK_SIZE))
            held.add(admit.worker_id)
    # The holder took the first LOAD_SLACK + 1, then the other got one and from then on both hold it.
    assert chosen[: LOAD_SLACK + 2] == ["w1"] * (LOAD_SLACK + 1) + ["w2"]
    assert abs(chosen.count("w1") - chosen.count("w2")) <= LOAD_SLACK + 1


def index_matcher(index: PrefixIndex) -> Callable[[QueuedRequest, int], dict[str, int]]:
    return lambda entry, block_size: index.matches(entry.prompt_hashes(block_size))


def only_w1_holds_the_prefix() -> Callable[[QueuedRequest, int], dict[str, int]]:
    index = PrefixIndex()
    index.store("w1", block_hashes(PREFIX, BLOCK_SIZE))
    return index_matcher(index)


def test_an_overloaded_holder_is_passed_over_only_while_another_has_room() -> None:
    (spread,) = plan_admissions(
        queue_of([conversation("a")]),
        [room("w1", 500, num_assigned=20), room("w2", 500)],
        256,
        only_w1_holds_the_prefix(),
    )
    assert isinstance(spread, Admit) and spread.worker_id == "w2"
    (held,) = plan_admissions(  # w2 has no room for the whole prompt: the holder takes it after all
        queue_of([conversation("a")]),
        [room("w1", 500, num_assigned=20), room("w2", 5)],
        256,
        only_w1_holds_the_prefix(),
    )
    assert isinstance(held, Admit) and (held.worker_id, held.reserved_blocks) == ("w1", 2)


def test_what_a_worker_was_sent_lately_counts_even_when_it_holds_nothing() -> None:
    """Workers that finish fast hold nothing: the load limit goes by what each was sent lately."""
    (spread,) = plan_admissions(
        queue_of([conversation("a")]),
        [room("w1", 500, recent=20.0), room("w2", 500)],
        256,
        only_w1_holds_the_prefix(),
    )
    assert isinstance(spread, Admit) and spread.worker_id == "w2"


def test_a_draining_worker_sets_no_one_s_load_limit() -> None:
    # Least busy of those taking requests: w3, at 10, so the limit is 1.25 x 10 + 4 and the holder is past it.
    rooms = [room("w1", 500, recent=30.0), room("w2", 0, draining=True), room("w3", 500, recent=10.0)]
    (admit,) = plan_admissions(queue_of([conversation("a")]), rooms, 256, only_w1_holds_the_prefix())
    assert isinstance(admit, Admit) and admit.worker_id == "w3"


def reference_plan(requests: list[GenerateRequest], rooms: list[WorkerRoom], index: PrefixIndex) -> list[str]:
    """Every worker scored for every request, by the rules the admission module states."""
    chosen = []
    for request in requests:
        blocks = request.num_blocks_for_prompt(BLOCK_SIZE)
        matched = index.matches(block_hashes(request.prompt_token_ids[:-1], BLOCK_SIZE))
        limit = LOAD_RATIO * min(r.busy for r in rooms if not r.draining) + LOAD_SLACK
        fits = [r for r in rooms if blocks - matched.get(r.worker_id, 0) <= r.available_blocks]
        under = [r for r in fits if r.busy <= limit] or fits
        scores = {
            r.worker_id: PREFIX_WEIGHT * matched.get(r.worker_id, 0) / blocks
            + r.available_blocks / r.capacity_blocks
            for r in under
        }
        ranks = {r.worker_id: (-scores[r.worker_id], r.load, r.worker_id) for r in under}
        best = min(under, key=lambda r: ranks[r.worker_id])
        best.available_blocks -= blocks - matched.get(best.worker_id, 0)
        best.num_assigned += 1
        best.recent_assigned += 1
        best.load += 1
        chosen.append(best.worker_id)
    return chosen


def random_rooms(seed: int) -> list[WorkerRoom]:
    state = random.Random(seed)
    return [
        room(f"w{w}", state.randrange(20, 1000), recent=state.choice([0.0, 3.0, 9.0]))
        for w in range(MAX_SCORED_HOLDERS)
    ]


def test_the_plan_chooses_what_scoring_every_worker_would() -> None:
    """The plan scores only some holders and walks a heap; with no more holders than it scores, its choices
    are those of scoring every worker for every request."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(50_000) for _ in range(6 * BLOCK_SIZE)] for _ in range(4)]
    for trial in range(30):
        index = PrefixIndex()
        for w in range(MAX_SCORED_HOLDERS):
            for prefix in rng.sample(prefixes, 2):
                index.store(f"w{w}", block_hashes(prefix[: rng.randrange(1, 7) * BLOCK_SIZE], BLOCK_SIZE))
        requests = [
            conversation(f"r{i}", prefix=rng.choice(prefixes), salt=i) for i in range(rng.randrange(1, 40))
        ]
        decisions = plan_admissions(queue_of(requests), random_rooms(trial), 256, index_matcher(index))
        assert [d.worker_id for d in decisions if isinstance(d, Admit)] == reference_plan(
            requests, random_rooms(trial), index
        )


# -- the scheduler, on Redis --------------------------------------------------------------------------


def test_the_scheduler_routes_by_the_workers_kv_events(
    redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys
) -> None:
    heartbeat(r, keys, "w1", free=100, total=100)
    heartbeat(r, keys, "w2", free=60, total=100)
    StagedWorker(r, keys, "w1")
    StagedWorker(r, keys, "w2").cache(prompt_of(PREFIX, salt=99))
    svc = make_service(redis_url, redis_prefix)
    submit(r, keys, conversation("hit"))
    svc.step()
    ((_, assignment),) = inbox(r, keys, "w2")
    assert assignment.request.request_id == "hit" and assignment.reserved_blocks == 2
    assert reserved(r, keys, "w2") == 2
    stats = SchedulerStats.from_hash(r.hgetall(keys.scheduler_stats))  # type: ignore[arg-type]
    assert (stats.routing_policy, stats.routed_prompt_blocks, stats.routed_matched_blocks) == (
        "prefix",
        10,
        8,
    )
    assert stats.kv_resyncs == 2 and stats.prefix_index_blocks == 9
    # ROUTING_POLICY=load: the same request goes to the freest worker.
    load = make_service(redis_url, redis_prefix, consumer="sched-load", routing_policy="load")
    submit(r, keys, conversation("by-load"))
    load.step()
    assert [a.request.request_id for _, a in inbox(r, keys, "w1")] == ["by-load"]
