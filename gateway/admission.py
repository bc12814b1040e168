"""Whether a request may be queued now: some worker is live and the scheduler's queue is not full."""

from __future__ import annotations

import logging
from typing import Any

import pydantic
import redis

from gateway.errors import overloaded
from shared.keys import Keys
from shared.protocol import Heartbeat, SchedulerStats

logger = logging.getLogger(__name__)


def _worker_ids(client: redis.Redis, keys: Keys) -> list[str]:
    members: Any = client.smembers(keys.workers)
    return sorted(m.decode() if isinstance(m, bytes) else m for m in members)


def live_worker_ids(client: redis.Redis, keys: Keys) -> list[str]:
    """Registered workers whose heartbeat has not expired."""
    worker_ids = _worker_ids(client, keys)
    if not worker_ids:
        return []
    pipe = client.pipeline(transaction=False)
    for wid in worker_ids:
        pipe.exists(keys.worker(wid))
    return [wid for wid, alive in zip(worker_ids, pipe.execute()) if alive]


def live_heartbeats(client: redis.Redis, keys: Keys) -> list[Heartbeat]:
    """The last heartbeat of every live worker."""
    worker_ids = _worker_ids(client, keys)
    pipe = client.pipeline(transaction=False)
    for wid in worker_ids:
        pipe.hgetall(keys.worker(wid))
    beats = []
    for wid, fields in zip(worker_ids, pipe.execute()):
        if not fields:
            continue
        try:
            beats.append(Heartbeat.from_hash(fields))
        except (pydantic.ValidationError, ValueError):
            logger.warning("worker %s: malformed heartbeat", wid)
    return beats


def scheduler_stats(client: redis.Redis, keys: Keys) -> SchedulerStats | None:
    fields = client.hgetall(keys.scheduler_stats)
    if not fields:
        return None
    try:
        return SchedulerStats.from_hash(fields)  # type: ignore[arg-type]
    except (pydantic.ValidationError, ValueError):
        logger.warning("malformed scheduler stats")
        return None


def check_admission(client: redis.Redis, keys: Keys, max_queue_len: int, retry_after_s: float) -> None:
    """Raises a 503 (with Retry-After) when the queue is full or no worker is live."""
    stats = scheduler_stats(client, keys)
    if stats is not None and stats.num_waiting >= max_queue_len:
        raise overloaded(
            f"the server is overloaded ({stats.num_waiting} requests waiting); retry later",
            retry_after=1.0,
            code="overloaded",
        )
    if not live_worker_ids(client, keys):
        raise overloaded(
            "no inference worker is available; retry later", retry_after=retry_after_s, code="no_worker"
        )
