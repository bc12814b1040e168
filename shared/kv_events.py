"""KV events: what each worker's prefix cache stores and evicts, for the schedulers' prefix index.

Per worker, two keys (shared.keys):
- `<p>:{<p>}:worker:<wid>:kv_blocks`, a set: every block hash (shared.prefix) its prefix cache holds, in use
  or evictable, as decimal strings;
- `<p>:{<p>}:worker:<wid>:kv_events`, a stream capped at about KV_EVENTS_MAXLEN entries: one entry per engine
  step that changed the cache (fields `seq`, `stored`, `removed`), or one that says the set was rewritten
  (`reset`).

The rules:
1. The worker writes a step's entry and the set's SADD/SREM in one MULTI, so the set is always the cache as
   of the stream's last entry. It numbers the entries 1, 2, ... from its start, a reset included.
2. The worker rewrites the whole set (and adds a reset entry) when it registers: at its start, and again
   after Redis was away (a write may have been lost, or Redis came back without the set).
3. A reader keeps, per worker, the id and `seq` of the last entry it applied. An entry whose seq is not the
   next one (a gap: the stream was trimmed past what it had read, or the worker started again) or that says
   reset, makes it resync: SMEMBERS of the set and the stream's last entry in one MULTI, then on from there.
   So a reader that starts late, falls behind or misses a write catches up by itself.
4. When a worker is declared dead, its set and stream are deleted with its other keys (failover), and readers
   drop what they knew of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

KV_EVENTS_MAXLEN = 1000  # entries kept per worker: a reader further behind resyncs from the set
SEQ_FIELD = "seq"
STORED_FIELD = "stored"
REMOVED_FIELD = "removed"
RESET_FIELD = "reset"


def encode_hashes(hashes: Iterable[int]) -> str:
    return " ".join(map(str, hashes))


def decode_hashes(text: str) -> list[int]:
    return [int(h) for h in text.split()]


@dataclass(slots=True)
class KVEvent:
    """One entry of a worker's KV event stream."""

    seq: int
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    reset: bool = False  # the set was rewritten: a reader reloads it

    def fields(self) -> dict[str, str]:
        if self.reset:
            return {SEQ_FIELD: str(self.seq), RESET_FIELD: "1"}
        return {
            SEQ_FIELD: str(self.seq),
            STORED_FIELD: encode_hashes(self.stored),
            REMOVED_FIELD: encode_hashes(self.removed),
        }

    @classmethod
    def read(cls, fields: dict[str, str]) -> KVEvent:
        """The entry's event; ValueError when it cannot be read (a reader then resyncs)."""
        try:
            return cls(
                seq=int(fields[SEQ_FIELD]),
                stored=decode_hashes(fields.get(STORED_FIELD, "")),
                removed=decode_hashes(fields.get(REMOVED_FIELD, "")),
                reset=fields.get(RESET_FIELD) == "1",
            )
        except (KeyError, ValueError) as exc:
            raise ValueError(f"unreadable KV event {fields!r}: {exc}") from exc
