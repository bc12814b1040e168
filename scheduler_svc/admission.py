"""Admission: which waiting requests go to which worker this round, decided on plain ints."""

from __future__ import annotations

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


def never_fits(request: GenerateRequest, rooms: Iterable[WorkerRoom]) -> RequestRejected | None:
    """Why no live worker could ever run the request, or None when one could (or none is live)."""
    rooms = list(rooms)
    if not rooms:
        return None
    num_prompt_tokens = len(request.prompt_token_ids)
    for room in rooms:
        if num_prompt_tokens < room.max_model_len and (
            request.num_blocks_for_prompt(room.block_size) <= room.capacity_blocks
        ):
            return None
    longest = max(rooms, key=lambda r: r.max_model_len)
    if num_prompt_tokens >= longest.max_model_len:
        return RequestRejected(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"prompt of {num_prompt_tokens} tokens reaches max_model_len {longest.max_model_len}",
        )
    largest = max(rooms, key=lambda r: r.capacity_blocks * r.block_size)
    return RequestRejected(
        ErrorCode.KV_CAPACITY_EXCEEDED,
        f"prompt needs {request.num_blocks_for_prompt(largest.block_size)} KV blocks of "
        f"{largest.block_size} tokens; the largest worker can hold {largest.capacity_blocks}",
    )


def _best_room(request: GenerateRequest, rooms: list[WorkerRoom], max_running: int) -> WorkerRoom | None:
    """The least-loaded room with space now: most available blocks, then fewest sequences, then id."""
    fitting = [
        r
        for r in rooms
        if r.num_assigned < max_running
        and len(request.prompt_token_ids) < r.max_model_len
        and request.num_blocks_for_prompt(r.block_size) <= r.available_blocks
    ]
    if not fitting:
        return None
    return min(fitting, key=lambda r: (-r.available_blocks, r.load, r.worker_id))


def plan_admissions(
    queue: Iterable[QueuedRequest], rooms: list[WorkerRoom], max_running: int
) -> list[Decision]:
    """Decisions for a prefix of the queue; stops at the first request that fits nowhere yet (no skipping)."""
    decisions: list[Decision] = []
    if not rooms:
        return decisions
    for entry in queue:
        error = never_fits(entry.request, rooms)
        if error is not None:
            decisions.append(Reject(entry, error))
            continue
        room = _best_room(entry.request, rooms, max_running)
        if room is None:
            break
        blocks = entry.request.num_blocks_for_prompt(room.block_size)
        room.available_blocks -= blocks
        room.num_assigned += 1
        room.load += 1
        decisions.append(Admit(entry, room.worker_id, blocks))
    return decisions
