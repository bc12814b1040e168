"""The Redis streams and what rides on them: the envelope of each stream's entries, their consumer groups,
stream ids, and the lease that lets one process at a time do a job.

| stream (shared.keys)        | entry fields                       | written by                | group     |
| --------------------------- | ---------------------------------- | ------------------------- | --------- |
| <p>:{<p>}:requests          | data: GenerateRequest              | gateway, batch, scheduler | scheduler |
| <p>:{<p>}:worker:<wid>:inbox | data: Assignment, blocks: reserved | scheduler (admit script)  | worker    |

The requests stream is capped (XADD MAXLEN ~) by every writer; a worker trims the inbox entries it has taken
with its heartbeat. An inbox entry is written by the scheduler's admit script (shared.reservations), which
names its fields from here.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pydantic
import redis

from shared.protocol import Assignment, GenerateRequest, decode, encode

SCHEDULER_GROUP = "scheduler"  # reads the requests stream
WORKER_GROUP = "worker"  # each worker reads its own inbox
# Writers of the requests stream trim it to about this many entries (XADD MAXLEN ~), far more than ever wait.
REQUESTS_STREAM_MAXLEN = 100_000
DATA_FIELD = "data"
BLOCKS_FIELD = "blocks"

StreamId = tuple[int, int]
Fields = dict[str, str] | None  # an entry deleted from the stream comes back without fields while pending


# -- envelopes ----------------------------------------------------------------------------------------------


def queue_request(pipe: Any, stream: str, request: GenerateRequest) -> Any:
    """Queue the request as an entry of the requests stream, on a pipeline (or a client: its entry id)."""
    return pipe.xadd(stream, {DATA_FIELD: encode(request)}, maxlen=REQUESTS_STREAM_MAXLEN, approximate=True)


def read_request(fields: Fields) -> GenerateRequest:
    """The request of a requests-stream entry; raises ValueError for one that cannot be read."""
    try:
        return decode(GenerateRequest, (fields or {})[DATA_FIELD])
    except (KeyError, pydantic.ValidationError) as exc:
        raise ValueError(f"unreadable request entry: {exc!r}") from exc


def inbox_entry(assignment: Assignment) -> dict[str, str]:
    """An inbox entry's fields (the admit script writes the same, with the blocks it reserved)."""
    return {DATA_FIELD: encode(assignment), BLOCKS_FIELD: str(assignment.reserved_blocks)}


def read_inbox_entry(fields: Fields) -> tuple[str | None, int]:
    """An inbox entry's assignment (as sent; None when the entry has none) and the blocks reserved for it (0
    when unreadable: nothing to give back)."""
    fields = fields or {}
    try:
        blocks = max(0, int(fields.get(BLOCKS_FIELD) or 0))
    except ValueError:
        blocks = 0
    return fields.get(DATA_FIELD), blocks


# -- consumer groups and ids -----------------------------------------------------------------------------


def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
    """Create the consumer group (and the stream) unless it exists; it reads the stream from its start."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def parse_stream_id(entry_id: str) -> StreamId:
    """A stream entry id ("ms-seq") as a tuple: ids compare in stream order, which strings do not."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def stream_ms(entry_id: str) -> int:
    """When Redis added a stream entry (its id's milliseconds, by the server's clock)."""
    return parse_stream_id(entry_id)[0]


def next_stream_id(entry_id: str) -> str:
    """The smallest stream id after entry_id."""
    ms, seq = parse_stream_id(entry_id)
    return f"{ms}-{seq + 1}"


# -- the lease -----------------------------------------------------------------------------------------------

# KEYS[1] the lease; ARGV[1] the holder's token, ARGV[2] the lease in ms. Extends the lease if the token still
# holds it (renew, ARGV[2] > 0) or lets it go (release, ARGV[2] = 0): 1 when the token held it.
_LEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) else redis.call('DEL', KEYS[1]) end
return 1
"""


class Lease:
    """Who does a job now (a scheduler's failover sweep, a batch's slice): a key with a TTL, held while it
    is renewed. A holder that dies loses it when the TTL runs out; only the holder renews or releases it."""

    def __init__(self, client: redis.Redis, key: str, ttl_s: float, holder: str = "") -> None:
        self._client = client
        self._key = key
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._token = f"{holder}:{uuid.uuid4().hex}"
        self._script = client.register_script(_LEASE_SCRIPT)
        self._renewed_at = 0.0

    def acquire(self) -> bool:
        self._renewed_at = time.monotonic()
        return bool(self._client.set(self._key, self._token, nx=True, px=self._ttl_ms))

    def renew(self, every_s: float = 0.0) -> bool:
        """Extend the lease (at most once per every_s); whether it is still this holder's."""
        now = time.monotonic()
        if now - self._renewed_at < every_s:
            return True
        self._renewed_at = now
        return bool(self._script(keys=[self._key], args=[self._token, self._ttl_ms]))

    def release(self) -> None:
        """Let the lease go, if it is still this holder's (it may have expired and been taken)."""
        self._script(keys=[self._key], args=[self._token, 0])
