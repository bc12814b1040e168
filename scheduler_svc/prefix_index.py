"""The prefix index: which live worker's prefix cache holds which blocks, kept from the workers' KV event
streams (shared.kv_events), and how much of a prompt each worker holds."""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Any, cast

import redis

from shared.keys import Keys
from shared.kv_events import KVEvent, decode_hashes

log = logging.getLogger(__name__)

READ_COUNT = 1000  # entries per worker per read


class PrefixIndex:
    """Block hash -> the workers holding it, and worker -> its hashes (to drop a worker at once)."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._held: dict[str, set[int]] = {}

    def __len__(self) -> int:
        """Distinct block hashes held by some worker."""
        return len(self._holders)

    def workers(self) -> list[str]:
        return list(self._held)

    def num_held(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))

    def store(self, worker_id: str, hashes: Collection[int]) -> None:
        held = self._held.setdefault(worker_id, set())
        for h in hashes:
            if h not in held:
                held.add(h)
                self._holders.setdefault(h, set()).add(worker_id)

    def remove(self, worker_id: str, hashes: Collection[int]) -> None:
        held = self._held.get(worker_id)
        if held is None:
            return
        for h in hashes:
            if h in held:
                held.discard(h)
                holders = self._holders[h]
                holders.discard(worker_id)
                if not holders:
                    del self._holders[h]

    def reset(self, worker_id: str, hashes: Collection[int]) -> None:
        self.drop(worker_id)
        self.store(worker_id, hashes)

    def drop(self, worker_id: str) -> None:
        for h in self._held.pop(worker_id, ()):
            holders = self._holders[h]
            holders.discard(worker_id)
            if not holders:
                del self._holders[h]

    def matches(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per worker that holds the first block: how many consecutive blocks from the start it holds, the
        longest runs first. Set operations per block, not a step per worker and block: a hot prefix is held
        by most workers."""
        alive: set[str] | frozenset[str] = frozenset()
        dropped: list[set[str] | frozenset[str]] = []  # dropped[d]: the workers whose run is d blocks
        for depth, h in enumerate(hashes):
            holders = self._holders.get(h)
            following = (alive & holders if depth else holders) if holders else frozenset()
            dropped.append(alive - following)
            alive = following
            if not alive:
                break
        else:
            dropped.append(alive)
        counts: dict[str, int] = {}
        for depth in range(len(dropped) - 1, 0, -1):
            counts.update(dict.fromkeys(dropped[depth], depth))
        return counts


class KVEventReader:
    """Keeps a PrefixIndex up to date with the live workers' KV event streams: one XREAD of all streams
    per update, and a resync (its set and last entry, in one MULTI) of a worker whose stream skips or resets.
    """

    def __init__(self, client: redis.Redis, keys: Keys, index: PrefixIndex | None = None) -> None:
        self._client = client
        self._keys = keys
        self.index = index or PrefixIndex()
        self._cursors: dict[str, tuple[str, int]] = {}  # worker -> (last entry id applied, its seq)
        self._workers_of: dict[str, str] = {}  # stream key -> worker
        self.num_events = 0  # entries applied
        self.num_resyncs = 0  # worker sets reloaded

    def update(self, live_worker_ids: Collection[str]) -> None:
        """Forget workers no longer live, read what the others published since the last update, resync
        those new to it or whose stream does not follow on (two round trips at most)."""
        for wid in [w for w in self._cursors if w not in live_worker_ids]:
            self._forget(wid)
        resync = [wid for wid in live_worker_ids if wid not in self._cursors]
        if self._cursors:
            resync += self._read()
        if resync:
            self._resync(resync)

    def forget_all(self) -> None:
        for wid in list(self._cursors):
            self._forget(wid)

    def _forget(self, wid: str) -> None:
        self.index.drop(wid)
        del self._cursors[wid]
        self._workers_of.pop(self._keys.kv_events(wid), None)

    def _read(self) -> list[str]:
        """Apply every new entry of the known workers; the workers that need a resync."""
        streams = {self._keys.kv_events(wid): cursor[0] for wid, cursor in self._cursors.items()}
        reply: Any = self._client.xread(cast(Any, streams), count=READ_COUNT)
        resync = []
        for stream, entries in reply or []:
            wid = self._workers_of[stream]
            last_id, last_seq = self._cursors[wid]
            for entry_id, fields in entries:
                try:
                    event = KVEvent.read(fields)
                except ValueError as exc:
                    log.warning("worker %s: %s; resyncing", wid, exc)
                    event = None
                if event is None or event.reset or event.seq != last_seq + 1:
                    resync.append(wid)
                    break
                self.index.store(wid, event.stored)
                self.index.remove(wid, event.removed)
                last_id, last_seq = entry_id, event.seq
                self.num_events += 1
            self._cursors[wid] = (last_id, last_seq)
        return resync

    def _resync(self, worker_ids: list[str]) -> None:
        pipe = self._client.pipeline(transaction=True)
        for wid in worker_ids:
            pipe.smembers(self._keys.kv_blocks(wid))
            pipe.xrevrange(self._keys.kv_events(wid), count=1)
        replies = pipe.execute()
        for i, wid in enumerate(worker_ids):
            members, last = replies[2 * i], replies[2 * i + 1]
            try:
                hashes = decode_hashes(" ".join(members))
                seq = KVEvent.read(last[0][1]).seq if last else 0
            except ValueError as exc:
                log.warning("worker %s: unreadable KV state (%s); treated as empty", wid, exc)
                hashes, seq = [], -1  # -1: whatever comes next resyncs again
            self.index.reset(wid, hashes)
            self._cursors[wid] = (last[0][0] if last else "0-0", seq)
            self._workers_of[self._keys.kv_events(wid)] = wid
            self.num_resyncs += 1
        log.debug("resynced the prefix index of %s", worker_ids)
