"""The scheduler's view of the workers: heartbeats, outstanding assignments, blocks reserved on each."""

from __future__ import annotations

from dataclasses import dataclass

import redis
from pydantic import ValidationError

from scheduler_svc.admission import WorkerRoom
from scheduler_svc.queue import StreamId, parse_stream_id
from shared.keys import Keys
from shared.protocol import Assignment, Heartbeat, decode
from shared.redis_client import NamedPipeline
from shared.registry import WorkerRegistry


@dataclass(slots=True)
class LiveWorker:
    """A worker whose heartbeat hash exists, and how many requests it holds (its assigned hash)."""

    heartbeat: Heartbeat
    num_assigned: int


class Reservations:
    """Blocks promised to assignments a worker has not taken in yet (inbox id after its inbox_last_id)."""

    def __init__(self) -> None:
        self._by_worker: dict[str, list[tuple[StreamId, int]]] = {}

    def known(self, worker_id: str) -> bool:
        return worker_id in self._by_worker

    def add(self, worker_id: str, inbox_entry_id: str, blocks: int) -> None:
        self._by_worker.setdefault(worker_id, []).append((parse_stream_id(inbox_entry_id), blocks))

    def track(self, worker_id: str) -> None:
        """Start tracking a worker (with nothing reserved) so it is not reloaded from its inbox."""
        self._by_worker.setdefault(worker_id, [])

    def release_through(self, worker_id: str, inbox_last_id: str) -> None:
        """Drop what the worker has taken in: its free_blocks already count those."""
        last = parse_stream_id(inbox_last_id)
        if worker_id in self._by_worker:
            self._by_worker[worker_id] = [(i, b) for i, b in self._by_worker[worker_id] if i > last]

    def reserved(self, worker_id: str) -> int:
        return sum(b for _, b in self._by_worker.get(worker_id, ()))

    def keep_only(self, worker_ids: set[str]) -> None:
        for wid in list(self._by_worker):
            if wid not in worker_ids:
                del self._by_worker[wid]

    def clear(self) -> None:
        self._by_worker.clear()


class WorkerView:
    """Live and dead workers as of the last refresh, with the blocks reserved on each."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self._client = client
        self._keys = keys
        self._registry = WorkerRegistry(client, keys)
        self.live: dict[str, LiveWorker] = {}
        self.dead: list[str] = []
        self.reservations = Reservations()

    @property
    def num_assigned(self) -> int:
        return sum(w.num_assigned for w in self.live.values())

    def refresh(self) -> None:
        """Two round trips (the registry, then every heartbeat and assigned count), plus one to rebuild the
        reservations of workers seen for the first time."""
        snapshot = self._registry.read(count_assigned=True)
        self.live = {
            wid: LiveWorker(heartbeat, snapshot.num_assigned[wid]) for wid, heartbeat in snapshot.live.items()
        }
        # An unreadable heartbeat (a worker mid-upgrade) is neither live nor dead.
        self.dead = snapshot.dead
        self._load_reservations([wid for wid in self.live if not self.reservations.known(wid)])
        for wid, worker in self.live.items():
            self.reservations.release_through(wid, worker.heartbeat.inbox_last_id)
        self.reservations.keep_only(set(self.live))

    def _load_reservations(self, worker_ids: list[str]) -> None:
        """Rebuild reservations of workers seen for the first time from their inboxes (a restart forgets)."""
        if not worker_ids:
            return
        pipe = NamedPipeline(self._client)
        for wid in worker_ids:
            pipe.named(wid).xrange(self._keys.inbox(wid), f"({self.live[wid].heartbeat.inbox_last_id}", "+")
        pending = pipe.execute()
        for wid in worker_ids:
            self.reservations.track(wid)
            for entry_id, fields in pending[wid]:
                try:
                    assignment = decode(Assignment, fields["data"])
                except (KeyError, ValidationError):
                    continue
                self.reservations.add(wid, entry_id, assignment.reserved_blocks)

    def record_assignment(self, worker_id: str, inbox_entry_id: str, blocks: int) -> None:
        self.reservations.add(worker_id, inbox_entry_id, blocks)
        if worker_id in self.live:
            self.live[worker_id].num_assigned += 1

    def rooms(self, watermark_blocks: int) -> list[WorkerRoom]:
        """Admission's picture of every live worker: available = free - waiting - reserved - watermark."""
        rooms = []
        for wid, worker in self.live.items():
            hb = worker.heartbeat
            assert hb.block_size > 0, f"worker {wid} reports block_size {hb.block_size}"
            rooms.append(
                WorkerRoom(
                    worker_id=wid,
                    block_size=hb.block_size,
                    available_blocks=hb.free_blocks
                    - hb.waiting_blocks
                    - self.reservations.reserved(wid)
                    - watermark_blocks,
                    capacity_blocks=hb.total_blocks - watermark_blocks,
                    max_model_len=hb.max_model_len,
                    num_assigned=worker.num_assigned,
                    load=hb.num_running + hb.num_waiting,
                )
            )
        return rooms
