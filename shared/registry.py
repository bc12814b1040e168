"""The worker registry as every reader sees it: the gateway (back-pressure, /ready, /metrics), the scheduler
(admission, failover) and the container health checks.

A worker registers its id in the workers set and keeps a heartbeat hash with a TTL; a registered worker whose
heartbeat has expired is dead (the scheduler re-queues its requests and removes it from the set). The
scheduler publishes its queue's state the same way.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import pydantic
import redis

from shared.keys import Keys
from shared.protocol import Heartbeat, SchedulerStats
from shared.redis_client import NamedPipeline

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RegistrySnapshot:
    """Every registered worker, as of one read."""

    live: dict[str, Heartbeat] = field(default_factory=dict)
    dead: list[str] = field(default_factory=list)  # registered, heartbeat expired
    # A heartbeat that exists but cannot be read (a worker of another version): neither live nor dead.
    unreadable: list[str] = field(default_factory=list)
    # Per live worker, when asked for: requests assigned to it, and blocks reserved for those not taken in.
    num_assigned: dict[str, int] = field(default_factory=dict)
    reserved_blocks: dict[str, int] = field(default_factory=dict)
    # Per live worker, when asked for: its KV map (shared.kv_map), None where it has none.
    kv_maps: dict[str, str | None] = field(default_factory=dict)


class WorkerRegistry:
    """Reads the workers set, their heartbeats and the scheduler's stats; writes nothing."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self._client = client
        self._keys = keys

    def worker_ids(self) -> list[str]:
        members: set[str] = self._client.smembers(self._keys.workers)  # type: ignore[assignment]
        return sorted(members)

    def live_worker_ids(self, model: str | None = None) -> list[str]:
        """Registered workers whose heartbeat exists (with model: that serve that model name); two round
        trips, reading one field of each heartbeat at most."""
        worker_ids = self.worker_ids()
        if not worker_ids:
            return []
        pipe = NamedPipeline(self._client)
        for wid in worker_ids:
            if model is None:
                pipe.named(wid).exists(self._keys.worker(wid))
            else:
                pipe.named(wid).hget(self._keys.worker(wid), "model")
        replies = pipe.execute()
        if model is None:
            return [wid for wid in worker_ids if replies[wid]]
        wanted = json.dumps(model)  # as Heartbeat.to_hash writes it
        return [wid for wid in worker_ids if replies[wid] == wanted]

    def read(self, *, with_load: bool = False, with_maps: bool = False) -> RegistrySnapshot:
        """Every registered worker's heartbeat (with_load: and its assignments and reservation counter;
        with_maps: and its KV map, in one transaction with the heartbeat, as the worker writes them, so that
        the two are of one moment): two round trips."""
        worker_ids = self.worker_ids()
        snapshot = RegistrySnapshot()
        if not worker_ids:
            return snapshot
        pipe = NamedPipeline(self._client, transaction=with_maps)
        for wid in worker_ids:
            pipe.named(("heartbeat", wid)).hgetall(self._keys.worker(wid))
            if with_load:
                pipe.named(("assigned", wid)).hlen(self._keys.assigned(wid))
                pipe.named(("reserved", wid)).get(self._keys.reserved(wid))
            if with_maps:
                pipe.named(("kv_map", wid)).get(self._keys.kv_map(wid))
        replies = pipe.execute()
        for wid in worker_ids:
            fields = replies[("heartbeat", wid)]
            if not fields:
                snapshot.dead.append(wid)
                continue
            try:
                snapshot.live[wid] = Heartbeat.from_hash(fields)
            except (pydantic.ValidationError, ValueError) as exc:
                logger.warning("unreadable heartbeat of worker %s: %s", wid, exc)
                snapshot.unreadable.append(wid)
                continue
            if with_load:
                snapshot.num_assigned[wid] = int(replies[("assigned", wid)])
                snapshot.reserved_blocks[wid] = max(0, int(replies[("reserved", wid)] or 0))
            if with_maps:
                snapshot.kv_maps[wid] = replies[("kv_map", wid)]
        return snapshot

    def scheduler_stats(self) -> SchedulerStats | None:
        """The scheduler's last stats, or None when none is fresh (or they cannot be read)."""
        fields: dict[str, str] = self._client.hgetall(self._keys.scheduler_stats)  # type: ignore[assignment]
        if not fields:
            return None
        try:
            return SchedulerStats.from_hash(fields)
        except (pydantic.ValidationError, ValueError):
            logger.warning("unreadable scheduler stats")
            return None
