"""A request's token record and events: written by the worker that runs it (or the scheduler that refuses it),
read back by the gateway (to fill gaps) and by failover (to resume it elsewhere).

Per sample, the record is a list of its token ids and, once it has ended, its SampleEnd in the request's
finished hash. Both are written in the same pipeline as the event and before it is published, so a receiver
that notices a gap finds the missing tokens recorded.

Every write is idempotent: tokens go in at their position (APPEND_TOKENS adds only what the record lacks), so
a writer may send the same event again, after an error or a failover that lost writes, and the record stays
what one send would have made.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import pydantic

from shared.keys import Keys
from shared.protocol import GenerateRequest, SampleEnd, TokenEvent, WireError, decode, encode

logger = logging.getLogger(__name__)


# KEYS[1] a sample's token record   ARGV[1] the position of the first token   ARGV[2] the record's TTL (s)
# ARGV[3..] the tokens. Appends those past the record's end; returns how many tokens the record lacks before
# ARGV[1] (0 when none: it is then complete up to the last token given).
APPEND_TOKENS = """
local have = redis.call('LLEN', KEYS[1])
local start = tonumber(ARGV[1])
if have < start then return start - have end
for first = have - start + 3, #ARGV, 1000 do
  redis.call('RPUSH', KEYS[1], unpack(ARGV, first, math.min(first + 999, #ARGV)))
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 0
"""


def push_event(pipe: Any, keys: Keys, event: TokenEvent, ttl_s: int) -> None:
    """Queue on pipe: record the event's tokens (at their position) and end, then publish it."""
    rid, index = event.request_id, event.index
    if event.token_ids:
        pipe.eval(APPEND_TOKENS, 1, keys.tokens(rid, index), event.start, ttl_s, *event.token_ids)
    end = event.sample_end
    if end is not None:
        pipe.hset(keys.finished(rid), str(index), encode(end))
        pipe.expire(keys.finished(rid), ttl_s)
    pipe.publish(keys.events(rid), encode(event))


def error_events(request: GenerateRequest, error: WireError, source: str) -> list[TokenEvent]:
    """The final event of every sample of a request that fails; source names who failed it."""
    return [
        TokenEvent(
            request_id=request.request_id,
            index=i,
            # A resumed sample has streamed these tokens already: the error event follows them.
            start=len(request.resume.get(i, [])),
            token_ids=[],
            finish_reason="error",
            error=error,
            num_prompt_tokens=len(request.prompt_token_ids),
            worker_id=source,
        )
        for i in request.sample_indices()
    ]


def parse_tokens(values: Iterable[str]) -> list[int]:
    """Token ids as LRANGE on a token record returns them."""
    return [int(v) for v in values]


def parse_ends(fields: Mapping[str, str]) -> dict[int, SampleEnd]:
    """The finished hash as HGETALL returns it: sample index -> how it ended (unreadable fields skipped)."""
    ends: dict[int, SampleEnd] = {}
    for index, data in fields.items():
        try:
            ends[int(index)] = decode(SampleEnd, data)
        except (ValueError, pydantic.ValidationError):
            logger.warning("skipping an unreadable end of sample %r: %r", index, data)
    return ends
