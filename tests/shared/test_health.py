"""Container health checks read the same keys the services write."""

from __future__ import annotations

import socket
import time

import pytest
import redis

from shared import health
from shared.keys import Keys
from shared.protocol import Heartbeat, SchedulerStats


def test_health_checks(monkeypatch: pytest.MonkeyPatch, redis_url: str, keys: Keys) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("REDIS_PREFIX", keys.prefix)
    client = redis.Redis.from_url(redis_url)
    assert health.main(["worker"]) == 1
    assert health.main(["scheduler"]) == 1
    assert health.main(["nonsense"]) == 2

    wid = f"{socket.gethostname()}-123"
    beat = Heartbeat(
        worker_id=wid,
        model="m",
        free_blocks=1,
        total_blocks=1,
        block_size=16,
        num_running=0,
        num_waiting=0,
        last_step_time=0.0,
        started_at=time.time(),
        max_model_len=2048,
    )
    client.hset(keys.worker(wid), mapping=beat.to_hash())  # type: ignore[arg-type]
    client.sadd(keys.workers, wid)
    assert health.main(["worker"]) == 0
    stats = SchedulerStats(num_waiting=0, num_assigned=0, updated_at=time.time())
    client.hset(keys.scheduler_stats, mapping=stats.to_hash())  # type: ignore[arg-type]
    assert health.main(["scheduler"]) == 0
