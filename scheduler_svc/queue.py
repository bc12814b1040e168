"""The waiting queue: requests read from the requests stream and not yet handed to a worker."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from shared.prefix import block_hashes
from shared.protocol import QUEUE_TIME_BUCKETS_S, GenerateRequest
from shared.streams import StreamId, parse_stream_id


@dataclass(slots=True)
class QueuedRequest:
    """A waiting request and the requests-stream entry to acknowledge once it has been handed on."""

    entry_id: str
    request: GenerateRequest
    order: tuple[int, float, StreamId] = field(init=False)
    _hashes: tuple[int, list[int]] | None = field(init=False, default=None)  # (block size, hashes)

    def __post_init__(self) -> None:
        self.order = (self.request.priority, self.request.arrival_time, parse_stream_id(self.entry_id))

    def prompt_hashes(self, block_size: int) -> list[int]:
        """The chained hashes (shared.prefix) of the prompt's blocks a prefix cache could give it: its full
        blocks, less one whose last token is the prompt's own (that token is always computed)."""
        if self._hashes is None or self._hashes[0] != block_size:
            tokens = self.request.prompt_token_ids
            end = max(0, (len(tokens) - 1) // block_size)
            self._hashes = (block_size, block_hashes(tokens, block_size, end_block=end))
        return self._hashes[1]


def _order(entry: QueuedRequest) -> tuple[int, float, StreamId]:
    return entry.order


class WaitingQueue:
    """Requests in admission order: priority (lower first), then arrival time, then stream order."""

    def __init__(self) -> None:
        self._entries: list[QueuedRequest] = []
        self._entry_ids: set[str] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[QueuedRequest]:
        return iter(self._entries)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._entry_ids

    def entry_ids(self) -> list[str]:
        return [e.entry_id for e in self._entries]

    def push(self, entry: QueuedRequest) -> bool:
        """Add an entry; False if already queued (an entry can be read twice: pending re-read, then claim)."""
        if entry.entry_id in self._entry_ids:
            return False
        # NOTE: a sorted list, not a heap: admission walks the queue in order without popping.
        insort(self._entries, entry, key=_order)
        self._entry_ids.add(entry.entry_id)
        return True

    def remove(self, entry_ids: Collection[str]) -> None:
        if not entry_ids:
            return
        drop = set(entry_ids)
        self._entries = [e for e in self._entries if e.entry_id not in drop]
        self._entry_ids -= drop

    def clear(self) -> None:
        self._entries.clear()
        self._entry_ids.clear()


class ModelQueues:
    """A waiting queue per model (GenerateRequest.model), so one model's backlog never holds up the head of
    another's; as a whole, it reads like one queue (length, ids, membership)."""

    def __init__(self) -> None:
        self._queues: dict[str, WaitingQueue] = {}
        self._model_of: dict[str, str] = {}  # entry id -> its model

    def __len__(self) -> int:
        return len(self._model_of)

    def __iter__(self) -> Iterator[QueuedRequest]:
        for queue in self._queues.values():
            yield from queue

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._model_of

    def entry_ids(self) -> list[str]:
        return list(self._model_of)

    def queues(self) -> dict[str, WaitingQueue]:
        """Each model's queue (only models with a request waiting)."""
        return dict(self._queues)

    def waiting_by_model(self) -> dict[str, int]:
        return {model: len(queue) for model, queue in self._queues.items()}

    def push(self, entry: QueuedRequest) -> bool:
        """Add an entry to its model's queue; False if already queued."""
        if entry.entry_id in self._model_of:
            return False
        model = entry.request.model
        self._queues.setdefault(model, WaitingQueue()).push(entry)
        self._model_of[entry.entry_id] = model
        return True

    def remove(self, entry_ids: Collection[str]) -> None:
        by_model: dict[str, list[str]] = {}
        for entry_id in entry_ids:
            model = self._model_of.pop(entry_id, None)
            if model is not None:
                by_model.setdefault(model, []).append(entry_id)
        for model, ids in by_model.items():
            queue = self._queues[model]
            queue.remove(ids)
            if not queue:
                del self._queues[model]

    def clear(self) -> None:
        self._queues.clear()
        self._model_of.clear()


class QueueTimes:
    """Histogram of the waits from the requests stream to a worker's inbox (QUEUE_TIME_BUCKETS_S)."""

    def __init__(self) -> None:
        self.buckets = [0] * (len(QUEUE_TIME_BUCKETS_S) + 1)  # cumulative; the last counts everything
        self.sum_s = 0.0

    @property
    def count(self) -> int:
        return self.buckets[-1]

    def observe(self, seconds: float) -> None:
        self.sum_s += seconds
        for i in range(bisect_left(QUEUE_TIME_BUCKETS_S, seconds), len(self.buckets)):
            self.buckets[i] += 1
