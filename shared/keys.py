"""Every Redis key and channel name pagedserve uses, in one place.

All names start with the configured prefix (`REDIS_PREFIX`, default `pagedserve`), so several deployments or
test runs can share one Redis. `rid` is a request id, `wid` a worker id, `i` a sample index.

| name                         | type                | writer                | reader               | TTL           |
| ---------------------------- | ------------------- | --------------------- | -------------------- | ------------- |
| {p}:requests                 | stream              | gateway, batch        | scheduler (group)    | MAXLEN ~      |
| {p}:workers                  | set                 | worker                | scheduler, gateway   | swept if dead |
| {p}:worker:{wid}             | hash                | worker (heartbeat)    | scheduler, gateway   | HEARTBEAT_TTL |
| {p}:worker:{wid}:inbox       | stream              | scheduler             | worker (group)       | gone if dead  |
| {p}:worker:{wid}:assigned    | hash rid→Assignment | scheduler; worker del | scheduler (failover) | gone if dead  |
| {p}:worker:{wid}:reserved    | int (blocks)        | scheduler +, worker - | scheduler            | gone if dead  |
| {p}:worker:{wid}:kv_blocks   | set of block hashes | worker                | scheduler (resync)   | gone if dead  |
| {p}:worker:{wid}:kv_events   | stream              | worker                | scheduler            | MAXLEN ~      |
| {p}:aborts                   | pub/sub             | gateway               | workers              | -             |
| {p}:request:{rid}:abort      | string              | gateway               | scheduler, worker    | REQUEST_TTL   |
| {p}:request:{rid}:meta       | string (json)       | gateway               | gateway              | REQUEST_TTL   |
| {p}:request:{rid}:attached   | zset id→lease       | gateway               | gateway              | REQUEST_TTL   |
| {p}:request:{rid}:events     | pub/sub             | worker, scheduler     | gateway              | -             |
| {p}:request:{rid}:tokens:{i} | list of ints        | worker                | scheduler, gateway   | REQUEST_TTL   |
| {p}:request:{rid}:finished   | hash i→SampleEnd    | worker, scheduler     | scheduler, gateway   | REQUEST_TTL   |
| {p}:scheduler:stats          | hash                | scheduler             | gateway              | HEARTBEAT_TTL |
| {p}:scheduler:lock           | string              | scheduler             | scheduler            | seconds       |
| {p}:files                    | zset fid→created    | gateway, batch        | gateway              | until deleted |
| {p}:file:{fid}               | string (json)       | gateway, batch        | gateway, batch       | until deleted |
| {p}:batches                  | zset bid→created    | gateway               | gateway              | pruned        |
| {p}:batch:{bid}              | hash                | gateway, batch        | gateway, batch       | BATCH_TTL     |
| {p}:batch:{bid}:claims       | hash custom_id→rids | batch                 | batch                | gone at end   |
| {p}:batch:{bid}:done         | hash custom_id→line | batch                 | batch                | gone at end   |
| {p}:batch:{bid}:lease        | string (runner)     | batch                 | batch                | seconds       |
| {p}:celery:*                 | Celery's own keys   | gateway, batch        | batch (Celery)       | Celery's      |

HEARTBEAT_TTL is HEARTBEAT_TTL_S and REQUEST_TTL is REQUEST_TTL_S (shared.settings). What the streams' entries
hold and their consumer groups are in shared.streams; the reservation counter's rules in shared.reservations;
the KV events' rules in shared.kv_events.
The scheduler writes a request's events and finished record only to refuse it (shared.records).

`fid` is a file id, `bid` a batch id. Files are kept until deleted (DELETE /v1/files/{id}). BATCH_TTL is
BATCH_RETENTION_S, set when a batch ends (the listing drops a batch whose record has gone); a batch's per-line
progress is deleted once its result files are written.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    """Key and channel names under one prefix."""

    prefix: str = "pagedserve"

    @property
    def requests(self) -> str:
        return f"{self.prefix}:requests"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def worker(self, wid: str) -> str:
        return f"{self.prefix}:worker:{wid}"

    def inbox(self, wid: str) -> str:
        return f"{self.prefix}:worker:{wid}:inbox"

    def assigned(self, wid: str) -> str:
        return f"{self.prefix}:worker:{wid}:assigned"

    def reserved(self, wid: str) -> str:
        return f"{self.prefix}:worker:{wid}:reserved"

    def kv_blocks(self, wid: str) -> str:
        return f"{self.prefix}:worker:{wid}:kv_blocks"

    def kv_events(self, wid: str) -> str:
        return f"{self.prefix}:worker:{wid}:kv_events"

    def kv_map(self, wid: str) -> str:
        """Its KV pool's block states (shared.kv_map), written with each heartbeat."""
        return f"{self.prefix}:worker:{wid}:kv_map"

    @property
    def routing_log(self) -> str:
        """The schedulers' latest routing decisions (a capped list, newest first), for the dashboard."""
        return f"{self.prefix}:scheduler:routing_log"

    @property
    def aborts(self) -> str:
        return f"{self.prefix}:aborts"

    def abort_flag(self, rid: str) -> str:
        return f"{self.prefix}:request:{rid}:abort"

    def request_meta(self, rid: str) -> str:
        return f"{self.prefix}:request:{rid}:meta"

    def attached(self, rid: str) -> str:
        return f"{self.prefix}:request:{rid}:attached"

    def events(self, rid: str) -> str:
        return f"{self.prefix}:request:{rid}:events"

    def tokens(self, rid: str, index: int) -> str:
        return f"{self.prefix}:request:{rid}:tokens:{index}"

    def finished(self, rid: str) -> str:
        return f"{self.prefix}:request:{rid}:finished"

    @property
    def scheduler_stats(self) -> str:
        return f"{self.prefix}:scheduler:stats"

    @property
    def scheduler_lock(self) -> str:
        return f"{self.prefix}:scheduler:lock"

    @property
    def files(self) -> str:
        return f"{self.prefix}:files"

    def file(self, fid: str) -> str:
        return f"{self.prefix}:file:{fid}"

    @property
    def batches(self) -> str:
        return f"{self.prefix}:batches"

    def batch(self, bid: str) -> str:
        return f"{self.prefix}:batch:{bid}"

    def batch_claims(self, bid: str) -> str:
        return f"{self.prefix}:batch:{bid}:claims"

    def batch_done(self, bid: str) -> str:
        return f"{self.prefix}:batch:{bid}:done"

    def batch_lease(self, bid: str) -> str:
        return f"{self.prefix}:batch:{bid}:lease"

    @property
    def celery_prefix(self) -> str:
        """Celery's broker and result keys start with this (its transports' global_keyprefix)."""
        return f"{self.prefix}:celery:"

    def all_patterns(self) -> list[str]:
        """Glob patterns matching every key under this prefix (tests clean up with these)."""
        return [f"{self.prefix}:*"]
