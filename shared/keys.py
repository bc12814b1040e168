"""Every Redis key and channel name pagedserve uses, in one place.

All names start with the configured prefix (`REDIS_PREFIX`, default `pagedserve`) and a colon, so several
deployments or test runs can share one Redis and `SCAN MATCH <p>:*` finds every key of one. In the table `<p>`
is the prefix, `<rid>` a request id, `<wid>` a worker id, `<i>` a sample index, `<bid>` a batch id, `<fid>` a
file id; braces are literal: they are the key's Redis Cluster hash tag, the part its slot is computed from.

The tags follow what must stay atomic (every multi-key script and MULTI touches one slot):
- `C` below is `<p>:{<p>}`, the control plane's head: the requests stream, the workers and every key of each
  worker share the tag `{<p>}`, because the admit script moves a request from the requests stream into a
  worker's inbox, assignments and reservation counter in one step, the heartbeat's MULTI gives reservations
  back and trims the inbox, and failover deletes a dead worker's keys while it re-queues its requests.
- A request's own keys carry its id, `{<rid>}`: they live on one slot, and requests spread over the cluster.
- A batch's keys carry its id, `{<bid>}` (its outcome script counts into its record), a file's record its id.
- The two listings stand alone; Celery's keys are Celery's.
How the keys would spread over a Redis Cluster, and what that costs, is in docs/sharding.md.

| name                            | type                | writer                    | reader               | TTL           |
| ------------------------------- | ------------------- | ------------------------- | -------------------- | ------------- |
| C:requests                      | stream              | gateway, batch, scheduler | scheduler (group)    | MAXLEN ~      |
| C:workers                       | set                 | worker                    | scheduler, gateway   | swept if dead |
| C:worker:<wid>                  | hash                | worker (heartbeat)        | scheduler, gateway   | HEARTBEAT_TTL |
| C:worker:<wid>:inbox            | stream              | scheduler                 | worker (group)       | gone if dead  |
| C:worker:<wid>:assigned         | hash rid→Assignment | scheduler; worker del     | scheduler (failover) | gone if dead  |
| C:worker:<wid>:reserved         | int (blocks)        | scheduler +, worker -     | scheduler            | gone if dead  |
| C:worker:<wid>:kv_blocks        | set of block hashes | worker                    | scheduler (resync)   | gone if dead  |
| C:worker:<wid>:kv_events        | stream              | worker                    | scheduler            | MAXLEN ~      |
| C:worker:<wid>:kv_map           | string (deflated)   | worker (heartbeat)        | gateway (dashboard)  | HEARTBEAT_TTL |
| C:aborts                        | pub/sub             | gateway                   | workers              | -             |
| C:scheduler:stats               | hash                | scheduler                 | gateway              | HEARTBEAT_TTL |
| C:scheduler:lock                | string              | scheduler                 | scheduler            | seconds       |
| C:scheduler:routing_log         | list (capped)       | scheduler                 | gateway (dashboard)  | 10 minutes    |
| <p>:request:{<rid>}:abort       | string              | gateway                   | scheduler, worker    | REQUEST_TTL   |
| <p>:request:{<rid>}:meta        | string (json)       | gateway                   | gateway              | REQUEST_TTL   |
| <p>:request:{<rid>}:attached    | zset id→lease       | gateway                   | gateway              | REQUEST_TTL   |
| <p>:request:{<rid>}:events      | pub/sub             | worker, scheduler         | gateway              | -             |
| <p>:request:{<rid>}:tokens:<i>  | list of ints        | worker                    | scheduler, gateway   | REQUEST_TTL   |
| <p>:request:{<rid>}:finished    | hash i→SampleEnd    | worker, scheduler         | scheduler, gateway   | REQUEST_TTL   |
| <p>:files                       | zset fid→created    | gateway, batch            | gateway              | until deleted |
| <p>:file:{<fid>}                | string (json)       | gateway, batch            | gateway, batch       | until deleted |
| <p>:batches                     | zset bid→created    | gateway                   | gateway              | pruned        |
| <p>:batch:{<bid>}               | hash                | gateway, batch            | gateway, batch       | BATCH_TTL     |
| <p>:batch:{<bid>}:claims        | hash custom_id→rids | batch                     | batch                | gone at end   |
| <p>:batch:{<bid>}:done          | hash custom_id→line | batch                     | batch                | gone at end   |
| <p>:batch:{<bid>}:lease         | string (runner)     | batch                     | batch                | seconds       |
| <p>:responses                   | zset id→created     | gateway                   | gateway              | pruned        |
| <p>:response:{<id>}             | string (json)       | gateway                   | gateway              | RESPONSE_TTL  |
| <p>:celery:*                    | Celery's own keys   | gateway, batch            | batch (Celery)       | Celery's      |

HEARTBEAT_TTL is HEARTBEAT_TTL_S and REQUEST_TTL is REQUEST_TTL_S (shared.settings), RESPONSE_TTL is
RESPONSE_TTL_S (gateway.settings). What the streams' entries hold and their consumer groups are in
shared.streams; the reservation counter's rules in shared.reservations; the KV events' rules in
shared.kv_events; the KV map's in shared.kv_map. The scheduler writes a request's events and finished record
only to refuse it (shared.records).

Files are kept until deleted (DELETE /v1/files/{id}). BATCH_TTL is BATCH_RETENTION_S, set when a batch ends
(the listing drops a batch whose record has gone); a batch's per-line progress is deleted once its result
files are written. A listing and its records are written one after the other, not atomically (they are on
different slots): the listing first, and a member whose record is missing is dropped from it after a grace.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    """Key and channel names under one prefix."""

    prefix: str = "pagedserve"

    def __post_init__(self) -> None:
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError(f"a key prefix cannot hold braces (they would be its hash tag): {self.prefix!r}")

    @property
    def control(self) -> str:
        """The head of every control-plane name: the prefix, then the prefix as the hash tag of one slot."""
        return f"{self.prefix}:{{{self.prefix}}}"

    # -- the control plane: one slot --------------------------------------------------------------------

    @property
    def requests(self) -> str:
        return f"{self.control}:requests"

    @property
    def workers(self) -> str:
        return f"{self.control}:workers"

    def worker(self, wid: str) -> str:
        return f"{self.control}:worker:{wid}"

    def inbox(self, wid: str) -> str:
        return f"{self.control}:worker:{wid}:inbox"

    def assigned(self, wid: str) -> str:
        return f"{self.control}:worker:{wid}:assigned"

    def reserved(self, wid: str) -> str:
        return f"{self.control}:worker:{wid}:reserved"

    def kv_blocks(self, wid: str) -> str:
        return f"{self.control}:worker:{wid}:kv_blocks"

    def kv_events(self, wid: str) -> str:
        return f"{self.control}:worker:{wid}:kv_events"

    def kv_map(self, wid: str) -> str:
        """Its KV pool's block states (shared.kv_map), written with each heartbeat."""
        return f"{self.control}:worker:{wid}:kv_map"

    @property
    def aborts(self) -> str:
        return f"{self.control}:aborts"

    @property
    def scheduler_stats(self) -> str:
        return f"{self.control}:scheduler:stats"

    @property
    def scheduler_lock(self) -> str:
        return f"{self.control}:scheduler:lock"

    @property
    def routing_log(self) -> str:
        """The schedulers' latest routing decisions (a capped list, newest first), for the dashboard."""
        return f"{self.control}:scheduler:routing_log"

    # -- a request's own: the slot of its id ------------------------------------------------------------

    def abort_flag(self, rid: str) -> str:
        return f"{self.prefix}:request:{{{rid}}}:abort"

    def request_meta(self, rid: str) -> str:
        return f"{self.prefix}:request:{{{rid}}}:meta"

    def attached(self, rid: str) -> str:
        return f"{self.prefix}:request:{{{rid}}}:attached"

    def events(self, rid: str) -> str:
        return f"{self.prefix}:request:{{{rid}}}:events"

    def tokens(self, rid: str, index: int) -> str:
        return f"{self.prefix}:request:{{{rid}}}:tokens:{index}"

    def finished(self, rid: str) -> str:
        return f"{self.prefix}:request:{{{rid}}}:finished"

    # -- the Batch API: a batch's keys on the slot of its id, a file's record on its own ----------------

    @property
    def files(self) -> str:
        return f"{self.prefix}:files"

    def file(self, fid: str) -> str:
        return f"{self.prefix}:file:{{{fid}}}"

    @property
    def batches(self) -> str:
        return f"{self.prefix}:batches"

    def batch(self, bid: str) -> str:
        return f"{self.prefix}:batch:{{{bid}}}"

    def batch_claims(self, bid: str) -> str:
        return f"{self.prefix}:batch:{{{bid}}}:claims"

    def batch_done(self, bid: str) -> str:
        return f"{self.prefix}:batch:{{{bid}}}:done"

    def batch_lease(self, bid: str) -> str:
        return f"{self.prefix}:batch:{{{bid}}}:lease"

    # -- the Responses API: the stored responses' listing, and each one's record on the slot of its id ---

    @property
    def responses(self) -> str:
        return f"{self.prefix}:responses"

    def response(self, rid: str) -> str:
        return f"{self.prefix}:response:{{{rid}}}"

    @property
    def celery_prefix(self) -> str:
        """Celery's broker and result keys start with this (its transports' global_keyprefix)."""
        return f"{self.prefix}:celery:"

    def all_patterns(self) -> list[str]:
        """Glob patterns matching every key under this prefix (tests clean up with these). Braces are
        literal in a Redis pattern, so this one matches the hash-tagged names too."""
        return [f"{self.prefix}:*"]
