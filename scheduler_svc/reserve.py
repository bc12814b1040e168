"""Reserving a worker's blocks for an assignment: the check and the reservation in one atomic step.

Every scheduler admits against the same numbers, kept in Redis: the worker's heartbeat (free and waiting
blocks, as of its last take-in) and its reservation counter (blocks promised to assignments in its inbox
that the heartbeat does not count yet: schedulers add to it, the worker takes its take-ins off it with the
heartbeat that counts them). A script checks that the request's blocks fit and, only then, reserves them,
queues the assignment and acknowledges the request's entry, so that schedulers admitting at the same time
never promise the same blocks twice, and an admitted entry is never handed on twice.
"""

from __future__ import annotations

from typing import Any

import redis

from shared.keys import SCHEDULER_GROUP, Keys
from shared.protocol import Assignment, encode

ADMIT_SCRIPT = """
-- KEYS[1] the worker's heartbeat (hash)   KEYS[2] its reservation counter   KEYS[3] its inbox (stream)
-- KEYS[4] its assignments (hash: request id -> assignment)   KEYS[5] the requests stream
-- ARGV[1] blocks to reserve   ARGV[2] watermark blocks   ARGV[3] most assignments a worker holds
-- ARGV[4] the assignment (json)   ARGV[5] request id
-- ARGV[6] the schedulers' consumer group   ARGV[7] the request's entry in the requests stream
-- Returns the inbox entry's id, or false when the worker is gone or has no room for the request now.
local beat = redis.call('HMGET', KEYS[1], 'free_blocks', 'waiting_blocks')
if not beat[1] then return false end
local reserved = math.max(0, tonumber(redis.call('GET', KEYS[2]) or '0'))
local available = tonumber(beat[1]) - tonumber(beat[2] or '0') - reserved - tonumber(ARGV[2])
if tonumber(ARGV[1]) > available then return false end
if redis.call('HLEN', KEYS[4]) >= tonumber(ARGV[3]) then return false end
redis.call('INCRBY', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[4], ARGV[5], ARGV[4])
local entry = redis.call('XADD', KEYS[3], '*', 'data', ARGV[4], 'blocks', ARGV[1])
redis.call('XACK', KEYS[5], ARGV[6], ARGV[7])
redis.call('XDEL', KEYS[5], ARGV[7])
return entry
"""


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
