"""The scheduler's view of the workers: heartbeats, outstanding assignments, blocks reserved on each."""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from scheduler_svc.admission import RECENT_HALF_LIFE_S, WorkerRoom
from shared.keys import Keys
from shared.protocol import Heartbeat
from shared.registry import WorkerRegistry
from shared.reservations import available_blocks


@dataclass(slots=True)
class LiveWorker:
    """A worker whose heartbeat hash exists, how many requests it holds (its assigned hash), and the blocks
    promised to assignments it has not taken in (its reservation counter)."""

    heartbeat: Heartbeat
    num_assigned: int
    reserved_blocks: int


class WorkerView:
    """Live and dead workers as of the last refresh, with the blocks reserved on each (the planner's picture;
    the admit script checks again at the moment it reserves)."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self._registry = WorkerRegistry(client, keys)
        self.live: dict[str, LiveWorker] = {}
        self.dead: list[str] = []
        self._recent: dict[str, tuple[float, float]] = {}  # worker -> (requests sent lately, as of when)

    @property
    def num_assigned(self) -> int:
        return sum(w.num_assigned for w in self.live.values())

    def refresh(self) -> None:
        """Two round trips: the registry, then every heartbeat, assigned count and reservation counter."""
        snapshot = self._registry.read(with_load=True)
        self.live = {
            wid: LiveWorker(heartbeat, snapshot.num_assigned[wid], snapshot.reserved_blocks[wid])
            for wid, heartbeat in snapshot.live.items()
        }
        # An unreadable heartbeat (a worker mid-upgrade) is neither live nor dead.
        self.dead = snapshot.dead
        self._recent = {wid: count for wid, count in self._recent.items() if wid in self.live}

    def record_assignment(self, worker_id: str, blocks: int) -> None:
        if worker_id in self.live:
            self.live[worker_id].num_assigned += 1
            self.live[worker_id].reserved_blocks += blocks
            now = time.monotonic()
            self._recent[worker_id] = (self.recent_assigned(worker_id, now) + 1, now)

    def recent_assigned(self, worker_id: str, now: float) -> float:
        """The requests sent to the worker lately: each counts 1 when sent, and halves every
        RECENT_HALF_LIFE_S."""
        count, at = self._recent.get(worker_id, (0.0, now))
        return count * 0.5 ** ((now - at) / RECENT_HALF_LIFE_S)

    def rooms(self, watermark_blocks: int) -> list[WorkerRoom]:
        """Every live worker as admission sees it: the room the admit script checks (shared.reservations)."""
        rooms, now = [], time.monotonic()
        for wid, worker in self.live.items():
            hb = worker.heartbeat
            assert hb.block_size > 0, f"worker {wid} reports block_size {hb.block_size}"
            rooms.append(
                WorkerRoom(
                    worker_id=wid,
                    block_size=hb.block_size,
                    # A draining worker keeps its place (what could fit somewhere) but takes nothing.
                    available_blocks=0
                    if hb.draining
                    else available_blocks(hb, worker.reserved_blocks, watermark_blocks),
                    capacity_blocks=hb.total_blocks - watermark_blocks,
                    max_model_len=hb.max_model_len,
                    num_assigned=worker.num_assigned,
                    load=hb.num_running + hb.num_waiting,
                    model=hb.model,
                    recent_assigned=self.recent_assigned(wid, now),
                    draining=hb.draining,
                )
            )
        return rooms
