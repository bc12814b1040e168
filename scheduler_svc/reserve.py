"""Reserving a worker's blocks for an assignment: the check and the reservation in one atomic step, by the
admit script of the reservation contract (shared.reservations, which says what each side does)."""

from __future__ import annotations

from typing import Any

import redis

from shared.keys import Keys
from shared.protocol import Assignment, encode
from shared.reservations import ADMIT_SCRIPT
from shared.streams import SCHEDULER_GROUP


class Reserver:
    """Queues admissions as calls of the admit script on a pipeline."""

    def __init__(self, client: redis.Redis, keys: Keys, watermark_blocks: int, max_assigned: int) -> None:
        self._script = client.register_script(ADMIT_SCRIPT)
        self._keys = keys
        self._watermark_blocks = watermark_blocks
        self._max_assigned = max_assigned

    def admit(self, pipe: Any, assignment: Assignment, entry_id: str) -> None:
        """Queue on pipe: reserve and hand on, if it fits (the reply: the inbox entry id, or None)."""
        keys, wid = self._keys, assignment.worker_id
        self._script(
            keys=[keys.worker(wid), keys.reserved(wid), keys.inbox(wid), keys.assigned(wid), keys.requests],
            args=[
                assignment.reserved_blocks,
                self._watermark_blocks,
                self._max_assigned,
                encode(assignment),
                assignment.request.request_id,
                SCHEDULER_GROUP,
                entry_id,
            ],
            client=pipe,
        )
