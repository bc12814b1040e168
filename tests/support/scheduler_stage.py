"""What the scheduler's tests stage around it in Redis: requests as a gateway submits them, workers'
heartbeats and inboxes as a worker keeps them."""

from __future__ import annotations

import itertools
import time
from typing import Any, cast

import redis

from scheduler_svc.service import SchedulerService
from scheduler_svc.settings import SchedulerSettings
from shared.keys import Keys
from shared.protocol import (
    Assignment,
    GenerateRequest,
    Heartbeat,
    decode,
)
from shared.reservations import give_back
from shared.sampling import SamplingSpec
from shared.streams import SCHEDULER_GROUP, next_stream_id, queue_request, read_inbox_entry

_arrival = itertools.count(1)
_prompts = itertools.count(1)


BLOCK_SIZE = 16


def make_settings(redis_url: str, prefix: str, **overrides: Any) -> SchedulerSettings:
    # Every step reads the heartbeats the test has just written.
    values = {"watermark_blocks": 2, "view_refresh_s": 0.0, **overrides}
    return SchedulerSettings(redis_url=redis_url, redis_prefix=prefix, **values)


def make_service(
    redis_url: str, prefix: str, consumer: str = "sched-a", **overrides: Any
) -> SchedulerService:
    return SchedulerService(make_settings(redis_url, prefix, **overrides), consumer=consumer)


def make_request(
    rid: str, num_blocks: int = 1, priority: int = 0, n: int = 1, arrival_time: float | None = None
) -> GenerateRequest:
    """A request whose prompt fills `num_blocks` blocks exactly, and shares no block with another's."""
    first = next(_prompts) * 100_000
    return GenerateRequest(
        request_id=rid,
        prompt_token_ids=list(range(first, first + num_blocks * BLOCK_SIZE)),
        sampling=SamplingSpec(n=n, max_tokens=8),
        priority=priority,
        arrival_time=next(_arrival) if arrival_time is None else arrival_time,
    )


def submit(r: redis.Redis, keys: Keys, request: GenerateRequest) -> str:
    """What the gateway does."""
    return str(queue_request(r, keys.requests, request))


def heartbeat(
    r: redis.Redis,
    keys: Keys,
    wid: str,
    free: int = 100,
    total: int = 100,
    num_running: int = 0,
    waiting_blocks: int = 0,
    max_model_len: int = 4096,
    draining: bool = False,
    model: str = "tiny",
) -> None:
    """What a worker does every heartbeat interval (a TTL long enough to outlive the test)."""
    hb = Heartbeat(
        worker_id=wid,
        model=model,
        free_blocks=free,
        total_blocks=total,
        block_size=BLOCK_SIZE,
        num_running=num_running,
        num_waiting=0,
        waiting_blocks=waiting_blocks,
        last_step_time=time.time(),
        started_at=time.time(),
        max_model_len=max_model_len,
        draining=draining,
    )
    pipe = r.pipeline()
    pipe.hset(keys.worker(wid), mapping=hb.to_hash())  # type: ignore[arg-type]
    pipe.expire(keys.worker(wid), 60)
    pipe.sadd(keys.workers, wid)
    pipe.execute()


def inbox(r: redis.Redis, keys: Keys, wid: str) -> list[tuple[str, Assignment]]:
    entries = cast(list[tuple[str, dict[str, str]]], r.xrange(keys.inbox(wid)))
    return [(entry_id, decode(Assignment, read_inbox_entry(fields)[0] or "")) for entry_id, fields in entries]


def inbox_rids(r: redis.Redis, keys: Keys, wid: str) -> list[str]:
    return [a.request.request_id for _, a in inbox(r, keys, wid)]


def num_pending(r: redis.Redis, keys: Keys) -> int:
    return int(r.xpending(keys.requests, SCHEDULER_GROUP)["pending"])


def take_in(
    r: redis.Redis, keys: Keys, wid: str, count: int, free: int, total: int = 10, waiting_blocks: int = 0
) -> None:
    """What a worker's heartbeat says after it takes in the first count entries of its inbox: their blocks
    leave the reservation counter as they enter its free and waiting blocks; the entries leave the inbox."""
    entries = inbox(r, keys, wid)[:count]
    last = entries[-1][0]
    give_back(r, keys, wid, sum(a.reserved_blocks for _, a in entries))
    heartbeat(r, keys, wid, free=free, total=total, waiting_blocks=waiting_blocks)
    r.xtrim(keys.inbox(wid), minid=next_stream_id(last), approximate=False)


def reserved(r: redis.Redis, keys: Keys, wid: str) -> int:
    return int(r.get(keys.reserved(wid)) or 0)
