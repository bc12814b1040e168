"""Admission: which waiting requests go to which worker this round, decided on plain ints.

Routing by prefix (ROUTING_POLICY=prefix): among the workers with room, and not busier than the least busy one
allows (at most LOAD_RATIO x its load + LOAD_SLACK requests), a request goes to the one with the highest
score `PREFIX_WEIGHT x matched / prompt blocks + available / capacity`: matched is the consecutive run of the
prompt's blocks from its start that the worker's prefix cache holds (the prefix index), available and
capacity are the worker's blocks (WorkerRoom). The request reserves only the blocks it must compute there.
Both terms are fractions, so a worker holding most of a prompt wins against any amount of free room
elsewhere, and one holding a block or two of a long prompt barely counts: among workers that hold nothing,
the freest wins. What spreads a prefix that every request shares is the load limit: it goes to a second
worker once the first is LOAD_SLACK requests busier, and from then on both hold it. A worker's load, for
the limit, is the larger of the requests it holds and those it was sent lately (a count that halves every
RECENT_HALF_LIFE_S): workers that finish fast hold little, and it is what they were sent that keeps them even.
With no worker under the limit that has room, the limit is dropped. With ROUTING_POLICY=load a request goes
to the worker with the most blocks available, and reserves them all.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
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
    model: str = ""  # the served model name (its heartbeat's): it takes requests for that model only
    # Requests sent to it lately: each counts 1 when sent, halving every RECENT_HALF_LIFE_S.
    recent_assigned: float = 0.0
    draining: bool = False  # takes nothing (available_blocks is 0), and sets no one's load limit

    @property
    def busy(self) -> float:
        """Its load for the load limit: the larger of what it holds and what it was sent lately."""
        return max(self.num_assigned, self.recent_assigned)


PREFIX_WEIGHT = 2.0  # a prompt held in full weighs twice an empty pool
# By prefix, a worker is chosen only while it is at most LOAD_RATIO x as busy as the least busy worker, plus
# LOAD_SLACK requests (WorkerRoom.busy): a prefix that every request shares spreads instead of herding them.
LOAD_RATIO = 1.25
LOAD_SLACK = 4
RECENT_HALF_LIFE_S = 5.0  # what a worker was sent lately: long enough to outlast a burst of fast requests
# Of the workers holding a prompt's first blocks, those with the longest runs are scored, this many at most:
# a hot prefix held by every worker costs a few scores, not one per worker.
MAX_SCORED_HOLDERS = 8


@dataclass(slots=True)
class Admit:
    """Send the entry to a worker, reserving there the blocks of its prompt the worker must compute."""

    entry: QueuedRequest
    worker_id: str
    reserved_blocks: int  # the prompt's blocks less those matched
    matched_blocks: int = 0  # the run of the prompt's blocks from its start that the worker holds
    score: float = 0.0  # the routing score that chose it
    runner_up: str | None = None  # the next best worker by that score, if any had room
    runner_up_score: float = 0.0

    @property
    def prompt_blocks(self) -> int:
        """The prompt's blocks, on the chosen worker's block size."""
        return self.reserved_blocks + self.matched_blocks


@dataclass(slots=True)
class Reject:
    """The entry can never run on any live worker: answer it with an error."""

    entry: QueuedRequest
    error: RequestRejected


Decision = Admit | Reject


Shape = tuple[int, int, int]  # block size, max_model_len, capacity in blocks


def rooms_of(rooms: list[WorkerRoom], model: str) -> list[WorkerRoom]:
    """The rooms of the workers that serve model (every room for a request of no model)."""
    return [r for r in rooms if r.model == model] if model else rooms


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


# (entry, block size) -> per worker, the blocks from the prompt's start its prefix cache holds, the
# workers holding the most first (the plan stops at the first that cannot beat the best so far).
Matcher = Callable[[QueuedRequest, int], dict[str, int]]


@dataclass(slots=True)
class Choice:
    room: WorkerRoom
    needed: int
    matched: int
    score: float

    @classmethod
    def of(cls, room: WorkerRoom, needed: int, matched: int) -> Choice:
        """The room scored for a prompt of needed + matched blocks, matched of them held there."""
        free = room.available_blocks / room.capacity_blocks if room.capacity_blocks > 0 else 0.0
        return cls(room, needed, matched, PREFIX_WEIGHT * matched / (needed + matched) + free)

    def rank(self) -> tuple[float, int, str]:
        """Best first: the highest score, then the least load, then the id."""
        return (-self.score, self.room.load, self.room.worker_id)


class Ranked:
    """The best two choices offered so far, by Choice.rank."""

    def __init__(self) -> None:
        self.best: Choice | None = None
        self.second: Choice | None = None
        self._ranks: tuple[tuple[float, int, str], ...] = ()

    def offer(self, choice: Choice) -> None:
        rank = choice.rank()
        if self.best is None or rank < self._ranks[0]:
            self.best, self.second = choice, self.best
            self._ranks = (rank, *self._ranks[:1])
        elif self.second is None or rank < self._ranks[1]:
            self.second = choice
            self._ranks = (self._ranks[0], rank)


class RoomHeap:
    """The rooms by preference (most available blocks, then least load, then id), for the next request to
    take the best that fits: O(log rooms) a request, not a scan of every worker. With prefix matches, the
    workers holding part of the prompt are weighed against the best of the others (the module's score), among
    the workers not loaded past the least loaded one (load_limit).

    A room charged out of heap order leaves stale entries behind; entries carry the room's version, and a
    stale one is dropped when it comes up.
    """

    def __init__(self, rooms: list[WorkerRoom]) -> None:
        self._rooms = {r.worker_id: r for r in rooms}
        self._versions = dict.fromkeys(self._rooms, 0)
        self._heap = [(-r.available_blocks, r.load, r.worker_id, 0, r) for r in rooms]
        heapq.heapify(self._heap)
        # Draining workers take nothing: their load, however low, must not hold the others back.
        self._loads = [(r.busy, r.worker_id, 0) for r in rooms if not r.draining]
        heapq.heapify(self._loads)
        self._block_sizes = {r.block_size for r in rooms}
        self._parked: list[tuple[float, tuple[int, int, str, int, WorkerRoom]]] = []  # (busy, heap entry)

    def take(
        self, request: GenerateRequest, max_running: int, matches: dict[str, int] | None = None
    ) -> tuple[Choice, Choice | None] | None:
        """The best room with space for request now (charged), and the runner-up; None if none has space."""
        blocks = {bs: request.num_blocks_for_prompt(bs) for bs in self._block_sizes}
        found = None
        limit = self.load_limit() if matches is not None else None
        if limit is not None:
            found = self._best_two(request, max_running, blocks, matches or {}, limit)
        if found is None:  # by load alone, or no worker under the load limit has room
            found = self._best_two(request, max_running, blocks, matches or {}, None)
        if found is None:
            return None
        best, runner_up = found
        room = best.room
        room.available_blocks -= best.needed
        room.num_assigned += 1
        room.recent_assigned += 1
        room.load += 1
        version = self._versions[room.worker_id] = self._versions[room.worker_id] + 1
        heapq.heappush(self._heap, (-room.available_blocks, room.load, room.worker_id, version, room))
        heapq.heappush(self._loads, (room.busy, room.worker_id, version))
        return best, runner_up

    def load_limit(self) -> float | None:
        """The busiest a worker may be to be chosen by prefix: LOAD_RATIO x the least busy worker's load,
        plus LOAD_SLACK (None when every worker drains)."""
        loads = self._loads
        while loads and loads[0][2] != self._versions[loads[0][1]]:
            heapq.heappop(loads)  # stale
        return LOAD_RATIO * loads[0][0] + LOAD_SLACK if loads else None

    def _best_two(
        self,
        request: GenerateRequest,
        max_running: int,
        blocks: dict[int, int],
        matches: dict[str, int],
        limit: float | None,
    ) -> tuple[Choice, Choice | None] | None:
        """The best two of: the matched rooms with space, and the first room in heap order with space for
        the whole prompt (under the load limit, if any). That room, the freest, can only lose to a holder of
        the prompt: when it is a holder itself, its matched choice stands for it.

        A hot prefix is held by most workers, and scoring them all is where the time would go: the holders
        come longest match first, at most MAX_SCORED_HOLDERS of them with space are scored, and the scan stops
        at the first whose score, with every block free, could not beat the runner-up's."""
        rooms, ranked = self._rooms, Ranked()
        other = self._best_other(request, max_running, blocks, limit)
        if other is not None and other.worker_id not in matches:
            ranked.offer(Choice.of(other, blocks[other.block_size], 0))
        scored = 0
        for wid, matched in matches.items():
            room = rooms.get(wid)
            if room is None or (limit is not None and room.busy > limit):
                continue
            prompt_blocks = blocks[room.block_size]
            ceiling = PREFIX_WEIGHT * matched / prompt_blocks + 1.0  # its score with every block free
            if ranked.second is not None and ceiling < ranked.second.score:
                break
            if self._fits(room, request, max_running, prompt_blocks - matched):
                ranked.offer(Choice.of(room, prompt_blocks - matched, matched))
                scored += 1
                if scored == MAX_SCORED_HOLDERS:
                    break
        return None if ranked.best is None else (ranked.best, ranked.second)

    @staticmethod
    def _fits(room: WorkerRoom, request: GenerateRequest, max_running: int, needed: int) -> bool:
        return (
            room.num_assigned < max_running
            and len(request.prompt_token_ids) < room.max_model_len
            and needed <= room.available_blocks
        )

    def _best_other(
        self, request: GenerateRequest, max_running: int, blocks: dict[int, int], limit: float | None
    ) -> WorkerRoom | None:
        """The first room in heap order with space for the whole prompt (and under the load limit, if any).
        A room found over the limit is parked until the limit reaches it: the limit only rises in a plan."""
        parked = self._parked
        while parked and (limit is None or parked[0][0] <= limit):
            heapq.heappush(self._heap, heapq.heappop(parked)[1])
        passed = []
        found = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            _, _, wid, version, room = entry
            if version != self._versions[wid]:
                continue  # stale: the room's current entry is elsewhere in the heap
            if limit is not None and room.busy > limit:
                heapq.heappush(parked, (room.busy, entry))
                continue
            passed.append(entry)
            needed = blocks[room.block_size]
            if needed > room.available_blocks and len(self._block_sizes) == 1:
                break  # the most available blocks of all, and too few: none has enough
            if self._fits(room, request, max_running, needed):
                found = room
                break
        for entry in passed:
            heapq.heappush(self._heap, entry)
        return found


def plan_admissions(
    queue: Iterable[QueuedRequest], rooms: list[WorkerRoom], max_running: int, matcher: Matcher | None = None
) -> list[Decision]:
    """Decisions for a prefix of the queue; stops at the first request that fits nowhere yet (no skipping).
    With a matcher, routes by prefix (the module's score); without, by available blocks."""
    decisions: list[Decision] = []
    if not rooms:
        return decisions
    heap, shapes = RoomHeap(rooms), shapes_of(rooms)
    block_sizes = {shape[0] for shape in shapes}
    block_size = next(iter(block_sizes)) if len(block_sizes) == 1 else None
    for entry in queue:
        error = never_fits(entry.request, shapes)
        if error is not None:
            decisions.append(Reject(entry, error))
            continue
        # NOTE: prefixes are matched when every worker has the same block size (one set of hashes).
        matches = matcher(entry, block_size) if matcher is not None and block_size is not None else None
        taken = heap.take(entry.request, max_running, matches)
        if taken is None:
            break
        best, runner_up = taken
        decisions.append(
            Admit(
                entry,
                best.room.worker_id,
                best.needed,
                matched_blocks=best.matched,
                score=best.score,
                runner_up=runner_up.room.worker_id if runner_up else None,
                runner_up_score=runner_up.score if runner_up else 0.0,
            )
        )
    return decisions
