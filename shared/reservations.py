"""Reserving a worker's KV blocks for the assignments in its inbox: the contract between the schedulers and
the workers, in one place.

Every scheduler admits against the same numbers, kept in Redis:
- the worker's heartbeat (`{p}:worker:{wid}`): its free blocks and the blocks its own waiting prompts will
  take (`free_blocks`, `waiting_blocks`), as of its last heartbeat, which counts every assignment it had
  taken in by then;
- its reservation counter (`{p}:worker:{wid}:reserved`): the blocks promised to assignments in its inbox
  that no heartbeat counts yet.

A worker has room for `available_blocks() = free - waiting - reserved - watermark`, where the watermark is the
scheduler's margin (its WATERMARK_BLOCKS setting). The rules:

1. A scheduler admits with ADMIT_SCRIPT: in one atomic step it checks that the request's blocks fit that
   room (and that the worker holds fewer assignments than allowed), and only then adds them to the counter,
   records the assignment in `{p}:worker:{wid}:assigned`, appends the inbox entry (its `blocks` field names
   what was reserved; shared.streams) and acknowledges and deletes the request's entry in the requests
   stream. So schedulers admitting at once never promise the same blocks twice, and an admitted request is
   never handed on twice. The scheduler's own view of the rooms (admission's plan) is only a guide: the
   script decides.
2. A worker that takes entries from its inbox adds up their `blocks`; its next heartbeat, which counts them
   in free_blocks and waiting_blocks, takes the same sum off the counter (give_back) and trims the taken
   entries from the inbox, in one MULTI. Between the two, the blocks are counted exactly once.
3. Readers clamp the counter at zero (a worker may give back after its counter was deleted): the admit
   script, and the registry reader for the scheduler's view (shared.registry).
4. A draining worker (heartbeat `draining`: it was asked to stop) has no room: the script refuses it, so
   from the heartbeat that says so on, its inbox gets nothing new.
5. After Redis was away (a failover may have lost the newest writes of either side), a worker recounts its
   counter with RECOUNT_SCRIPT: the blocks of the inbox entries after the last one it took in, which no
   heartbeat counts yet, and starts its next heartbeat's give-back from zero.
6. When a worker is declared dead its inbox, assignments and counter are deleted together (failover); a
   worker that finds its inbox gone forgets what it had taken in (its counter went with it).

The blocks a request takes are GenerateRequest.num_blocks_for_prompt(block_size): its prompt and any tokens
its samples resume from.
"""

from __future__ import annotations

from typing import Any

from shared.keys import Keys
from shared.protocol import Heartbeat
from shared.streams import BLOCKS_FIELD, DATA_FIELD

ADMIT_SCRIPT = f"""
-- KEYS[1] the worker's heartbeat (hash)   KEYS[2] its reservation counter   KEYS[3] its inbox (stream)
-- KEYS[4] its assignments (hash: request id -> assignment)   KEYS[5] the requests stream
-- ARGV[1] blocks to reserve   ARGV[2] watermark blocks   ARGV[3] most assignments a worker holds
-- ARGV[4] the assignment (json)   ARGV[5] request id
-- ARGV[6] the schedulers' consumer group   ARGV[7] the request's entry in the requests stream
-- Returns the inbox entry's id, or false when the worker is gone, draining or without room for the request.
local beat = redis.call('HMGET', KEYS[1], 'free_blocks', 'waiting_blocks', 'draining')
if not beat[1] or beat[3] == 'true' then return false end
local reserved = math.max(0, tonumber(redis.call('GET', KEYS[2]) or '0'))
local available = tonumber(beat[1]) - tonumber(beat[2] or '0') - reserved - tonumber(ARGV[2])
if tonumber(ARGV[1]) > available then return false end
if redis.call('HLEN', KEYS[4]) >= tonumber(ARGV[3]) then return false end
redis.call('INCRBY', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[4], ARGV[5], ARGV[4])
local entry = redis.call('XADD', KEYS[3], '*', '{DATA_FIELD}', ARGV[4], '{BLOCKS_FIELD}', ARGV[1])
redis.call('XACK', KEYS[5], ARGV[6], ARGV[7])
redis.call('XDEL', KEYS[5], ARGV[7])
return entry
"""


RECOUNT_SCRIPT = f"""
-- KEYS[1] the worker's inbox   KEYS[2] its reservation counter
-- ARGV[1] the last entry the worker took in ('0-0': none)
-- Sets the counter to the blocks of the entries after that one; returns them.
local total = 0
for _, entry in ipairs(redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+')) do
  local fields = entry[2]
  for i = 1, #fields, 2 do
    if fields[i] == '{BLOCKS_FIELD}' then total = total + tonumber(fields[i + 1]) end
  end
end
redis.call('SET', KEYS[2], total)
return total
"""


def available_blocks(heartbeat: Heartbeat, reserved_blocks: int, watermark_blocks: int) -> int:
    """The room ADMIT_SCRIPT checks against, as the scheduler's view computes it (reserved_blocks as the
    registry reads it, clamped at zero)."""
    return heartbeat.free_blocks - heartbeat.waiting_blocks - reserved_blocks - watermark_blocks


def give_back(pipe: Any, keys: Keys, worker_id: str, blocks: int) -> None:
    """Queue on the heartbeat's MULTI: the blocks of the entries taken in since the last one leave the
    counter, as the heartbeat starts counting them."""
    if blocks:
        pipe.decrby(keys.reserved(worker_id), blocks)
