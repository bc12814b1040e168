"""A batch's record in Redis (shared.batches) and its per-line progress: the one module that reads and writes
them, for the gateway's routes and the batch workers alike."""

from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from gateway.serving.batch_files import listing_page
from shared.batches import ENDED_STATUSES, BatchSpec, BatchStatus
from shared.keys import Keys
from shared.protocol import decode, encode

_COUNTS = ("total", "completed", "failed")
_TIMESTAMPS = ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")

# KEYS[1] the batch's done hash, KEYS[2] the batch's record; ARGV[1] custom_id, ARGV[2] its output line,
# ARGV[3] the count it adds to ("completed" or "failed"). Records a line's outcome once: 1 if this call did.
_RECORD_LINE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  return 1
end
return 0
"""


class BatchRecord:
    """One batch's record as read: its spec and the fields that change."""

    def __init__(self, fields: dict[str, str]) -> None:
        self.spec = decode(BatchSpec, fields["spec"])
        self.fields = fields

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def status(self) -> BatchStatus:
        return self.fields["status"]  # type: ignore[return-value]

    @property
    def ended(self) -> bool:
        return self.status in ENDED_STATUSES

    def count(self, name: str) -> int:
        return int(self.fields.get(name, 0))

    def api(self) -> dict[str, Any]:
        """The batch object of OpenAI's API."""
        spec, fields = self.spec, self.fields
        errors = json.loads(fields["errors"]) if "errors" in fields else None
        return {
            "id": spec.id,
            "object": "batch",
            "endpoint": spec.endpoint,
            "errors": errors,
            "input_file_id": spec.input_file_id,
            "completion_window": spec.completion_window,
            "status": self.status,
            "output_file_id": fields.get("output_file_id"),
            "error_file_id": fields.get("error_file_id"),
            "created_at": spec.created_at,
            **{f"{s}_at": _int_or_none(fields.get(f"{s}_at")) for s in _TIMESTAMPS},
            "expires_at": spec.expires_at,
            "request_counts": {n: self.count(n) for n in ("total", "completed", "failed")},
            "metadata": spec.metadata,
        }


def _int_or_none(value: str | None) -> int | None:
    return None if value is None else int(value)


@dataclass
class BatchProgress:
    """The newest batches by status, and the lines of those not yet ended by outcome: what /metrics shows."""

    by_status: collections.Counter[str] = field(default_factory=collections.Counter)
    lines: collections.Counter[str] = field(default_factory=collections.Counter)  # total, completed, failed


class BatchStore:
    """Batches by id: create, read, list, move through the statuses, and count their lines' outcomes."""

    def __init__(self, client: redis.Redis, keys: Keys, retention_s: int) -> None:
        self._client = client
        self.keys = keys
        self._retention_s = retention_s
        self._record_line = client.register_script(_RECORD_LINE)

    def create(self, spec: BatchSpec) -> BatchRecord:
        fields = {"spec": encode(spec), "status": "validating", "total": "0", "completed": "0", "failed": "0"}
        # Listed first, then written: the listing is on a slot of its own (batch_files.UNLISTED_GRACE_S).
        pipe = self._client.pipeline(transaction=False)
        pipe.zadd(self.keys.batches, {spec.id: time.time()})
        pipe.hset(self.keys.batch(spec.id), mapping=fields)  # type: ignore[arg-type]
        pipe.execute()
        return BatchRecord(fields)

    def delete(self, batch_id: str) -> None:
        """Forget a batch that never started (it could not be queued): its record, then its listing."""
        pipe = self._client.pipeline(transaction=False)
        pipe.delete(self.keys.batch(batch_id))
        pipe.zrem(self.keys.batches, batch_id)
        pipe.execute()

    def get(self, batch_id: str) -> BatchRecord | None:
        fields = self._client.hgetall(self.keys.batch(batch_id))
        if not fields or "spec" not in fields:
            return None
        return BatchRecord(cast(dict[str, str], fields))  # (replies are decoded: shared.redis_client)

    def page(self, *, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        return listing_page(self._client, self.keys.batches, after, limit, self.get)

    def progress(self, newest: int) -> BatchProgress:
        """The statuses of the `newest` batches and the line counts of those among them not ended (two round
        trips, whatever the number of batches kept)."""
        ids = cast(list[str], self._client.zrevrange(self.keys.batches, 0, newest - 1))
        pipe = self._client.pipeline(transaction=False)
        for batch_id in ids:
            pipe.hmget(self.keys.batch(batch_id), "status", *_COUNTS)
        progress = BatchProgress()
        for status, *counts in pipe.execute() if ids else []:
            if status is None:  # expired since the listing was read
                continue
            progress.by_status[status] += 1
            if status not in ENDED_STATUSES:
                progress.lines.update({name: int(n or 0) for name, n in zip(_COUNTS, counts)})
        return progress

    def move(
        self, batch_id: str, allowed: frozenset[str] | set[str], to: BatchStatus, **fields: object
    ) -> bool:
        """Set the status to `to` (with its timestamp and the given fields) if it is one of `allowed` now;
        whether it was. A batch that ends keeps its record for the retention time."""
        key = self.keys.batch(batch_id)
        with self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    status = pipe.hget(key, "status")
                    if status is None or status not in allowed:
                        return False
                    pipe.multi()
                    update: dict[str, str] = {"status": to}
                    if to in _TIMESTAMPS:
                        update[f"{to}_at"] = str(int(time.time()))
                    update |= {k: v if isinstance(v, str) else json.dumps(v) for k, v in fields.items()}
                    pipe.hset(key, mapping=update)  # type: ignore[arg-type]
                    if to in ENDED_STATUSES:
                        pipe.expire(key, self._retention_s)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue

    def set_total(self, batch_id: str, total: int) -> None:
        self._client.hset(self.keys.batch(batch_id), "total", total)

    # -- per-line progress (the batch workers') ------------------------------------------------------------

    def claim(self, batch_id: str, custom_id: str, request_ids: list[str]) -> list[str] | None:
        """Note the requests a line is about to queue, unless it has some already: None when this call claimed
        it, else the requests an earlier run queued for it (the line must not run twice)."""
        key = self.keys.batch_claims(batch_id)
        pipe = self._client.pipeline(transaction=True)
        pipe.hsetnx(key, custom_id, json.dumps(request_ids))
        pipe.hget(key, custom_id)
        claimed, held = pipe.execute()
        return None if claimed else json.loads(held)

    def reclaim(self, batch_id: str, custom_id: str, request_ids: list[str]) -> None:
        """The line's requests are now these (its earlier ones were lost before they ran)."""
        self._client.hset(self.keys.batch_claims(batch_id), custom_id, json.dumps(request_ids))

    def release(self, batch_id: str, custom_id: str) -> None:
        """The line is to run again later (it failed for a reason that may pass)."""
        self._client.hdel(self.keys.batch_claims(batch_id), custom_id)

    def record(self, batch_id: str, custom_id: str, line: dict[str, Any], *, failed: bool) -> bool:
        """Keep a line's outcome and count it, once: whether this call did."""
        keys = [self.keys.batch_done(batch_id), self.keys.batch(batch_id)]
        args = [custom_id, json.dumps(line, ensure_ascii=False), "failed" if failed else "completed"]
        return bool(self._record_line(keys=keys, args=args))

    def done_ids(self, batch_id: str) -> set[str]:
        return set(cast(list[str], self._client.hkeys(self.keys.batch_done(batch_id))))

    def done_lines(self, batch_id: str) -> dict[str, str]:
        return cast(dict[str, str], self._client.hgetall(self.keys.batch_done(batch_id)))

    def drop_progress(self, batch_id: str) -> None:
        self._client.delete(self.keys.batch_claims(batch_id), self.keys.batch_done(batch_id))
