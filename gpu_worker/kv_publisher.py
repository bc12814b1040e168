"""The worker's KV events: after each step, what its prefix cache stored and evicted, in one MULTI with the
set of every hash it holds (the rules are in shared.kv_events)."""

from __future__ import annotations

from typing import Any

import redis

from gpu_worker.engine.block_allocator import BlockAllocator
from shared.keys import Keys
from shared.kv_events import KV_EVENTS_MAXLEN, KVEvent

SADD_CHUNK = 10_000  # hashes per SADD of a rewrite (one command stays small)


class KVPublisher:
    """Publishes one worker's prefix-cache changes; rewrites its whole set when one may have been lost."""

    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, allocator: BlockAllocator) -> None:
        self._client = client
        self._blocks = keys.kv_blocks(worker_id)
        self._events = keys.kv_events(worker_id)
        self._allocator = allocator
        allocator.record_kv_events()
        self.seq = 0
        self._rewrite_due = True
        self.num_events = 0  # entries written, resets included
        self.num_hashes = 0  # hashes they carried

    def publish(self) -> None:
        """After a step: its changes, if any (a rewrite instead when one is due). A Redis error propagates,
        and the next call rewrites: the changes taken here are in the cache's current state."""
        if self._rewrite_due:
            self.rewrite()
            return
        stored, removed = self._allocator.take_kv_events()
        if not stored and not removed:
            return
        self._rewrite_due = True  # until this MULTI is known to have been applied
        pipe = self._client.pipeline(transaction=True)
        if stored:
            pipe.sadd(self._blocks, *stored)
        if removed:
            pipe.srem(self._blocks, *removed)
        self._append(pipe, KVEvent(self.seq + 1, stored, removed))
        pipe.execute()
        self.seq += 1
        self._rewrite_due = False
        self.num_events += 1
        self.num_hashes += len(stored) + len(removed)

    def rewrite(self) -> None:
        """The whole set, from the cache as it is now, and a reset entry that tells readers to reload it."""
        self._allocator.take_kv_events()  # all of it is in what is written now
        hashes = self._allocator.cached_hashes()
        self._rewrite_due = True
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(self._blocks)
        for start in range(0, len(hashes), SADD_CHUNK):
            pipe.sadd(self._blocks, *hashes[start : start + SADD_CHUNK])
        self._append(pipe, KVEvent(self.seq + 1, reset=True))
        pipe.execute()
        self.seq += 1
        self._rewrite_due = False
        self.num_events += 1

    def _append(self, pipe: Any, event: KVEvent) -> None:
        pipe.xadd(self._events, event.fields(), maxlen=KV_EVENTS_MAXLEN, approximate=True)
