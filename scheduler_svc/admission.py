"""Admission: which waiting requests go to which worker this round, decided on plain ints."""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

from scheduler_svc.queue import QueuedRequest
from shared.errors import ErrorCode, RequestRejected
from shared.protocol import GenerateRequest


@dataclass(slots=True)
class WorkerRoom:
    """One live worker as admission sees it this round."""

    worker_id: str
    block_size: int
    # free - waiting - reserved - watermark, less what this round has already planned for it.
    available_blocks: int
    # total - watermark: the most blocks one prompt can ever take here.
    capacity_blocks: int
    max_model_len: int
    num_assigned: int
    # running + waiting, plus this round's plans: the tie-break between equally free workers.
    load: int


@dataclass(slots=True)
class Admit:
    """Send the entry to a worker, reserving its prompt's blocks there."""

    entry: QueuedRequest
    worker_id: str
    reserved_blocks: int


@dataclass(slots=True)
class Reject:
    """The entry can never run on any live worker: answer it with an error."""

    entry: QueuedRequest
    error: RequestRejected


Decision = Admit | Reject


Shape = tuple[int, int, int]  # block size, max_model_len, capacity in blocks


def shapes_of(rooms: Iterable[WorkerRoom]) -> set[Shape]:
    """The distinct shapes of the workers (mostly one): what never_fits looks at."""
    return {(r.block_size, r.max_model_len, r.capacity_blocks) for r in rooms}


def never_fits(request: GenerateRequest, shapes: set[Shape]) -> RequestRejected | None:
    """Why no live worker could ever run the request, or None when one could (or none is live)."""
    if not shapes:
        return None
    num_prompt_tokens = len(request.prompt_token_ids)
    for block_size, max_model_len, capacity in shapes:
        if num_prompt_tokens < max_model_len and request.num_blocks_for_prompt(block_size) <= capacity:
            return None
    longest = max(max_model_len for _, max_model_len, _ in shapes)
    if num_prompt_tokens >= longest:
        return RequestRejected(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"prompt of {num_prompt_tokens} tokens reaches max_model_len {longest}",
        )
    block_size, _, capacity = max(shapes, key=lambda shape: shape[2] * shape[0])
    return RequestRejected(
        ErrorCode.KV_CAPACITY_EXCEEDED,
        f"prompt needs {request.num_blocks_for_prompt(block_size)} KV blocks of "
        f"{block_size} tokens; the largest worker can hold {capacity}",
    )


class RoomHeap:
    """The rooms by preference (most available blocks, then least load, then id), for the next request to
    take the best that fits: O(log rooms) a request, not a scan of every worker."""

    def __init__(self, rooms: list[WorkerRoom]) -> None:
        self._heap = [(-r.available_blocks, r.load, r.worker_id, r) for r in rooms]
        heapq.heapify(self._heap)
        self._block_sizes = {r.block_size for r in rooms}

    def take(self, request: GenerateRequest, max_running: int) -> tuple[WorkerRoom, int] | None:
        """The best room with space for request now and the blocks it takes there (the room is charged)."""
        num_prompt_tokens = len(request.prompt_token_ids)
        blocks = {bs: request.num_blocks_for_prompt(bs) for bs in self._block_sizes}
        passed = []
        found = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            room = entry[3]
            needed = blocks[room.block_size]
            if needed > room.available_blocks and len(self._block_sizes) == 1:
                passed.append(entry)  # the most available blocks of all, and too few: none has enough
                break
            if (
                room.num_assigned < max_running
                and num_prompt_tokens < room.max_model_len
                and (needed <= room.available_blocks)
            ):
                room.available_blocks -= needed
                room.num_assigned += 1
                room.load += 1
                passed.append((-room.available_blocks, room.load, room.worker_id, room))
                found = (room, needed)
                break
            passed.append(entry)
        for entry in passed:
            heapq.heappush(self._heap, entry)
        return found


def plan_admissions(
    queue: Iterable[QueuedRequest], rooms: list[WorkerRoom], max_running: int
) -> list[Decision]:
    """Decisions for a prefix of the queue; stops at the first request that fits nowhere yet (no skipping)."""
    decisions: list[Decision] = []
    if not rooms:
        return decisions
    heap, shapes = RoomHeap(rooms), shapes_of(rooms)
    for entry in queue:
        error = never_fits(entry.request, shapes)
        if error is not None:
            decisions.append(Reject(entry, error))
            continue
        taken = heap.take(entry.request, max_running)
        if taken is None:
            break
        room, blocks = taken
        decisions.append(Admit(entry, room.worker_id, blocks))
    return decisions
