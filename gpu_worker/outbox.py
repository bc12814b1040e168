"""The worker's writes to Redis, queued during one loop iteration and sent together.

Sent in one pipeline. Every write is idempotent (tokens go in at their position, shared.records; the rest
sets, deletes and acknowledges; an event published twice is dropped by its receiver as a duplicate), so a send
that failed part way is simply sent again: the writes stay queued until a send succeeds, and the worker steps
its engine only with an empty outbox, so what a client is owed is never lost to an outage.

What was sent in the last resend_window_s is kept too: a failover may promote a replica that never received
the newest writes (replication is asynchronous), and a Redis restarted from its append-only file may lack
the last second. After Redis was away, resend() writes all of it again, which restores whatever of it the
new master lacks and changes nothing else.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import redis

# The commands the worker queues (token records, events, assignment and inbox bookkeeping).
WRITES = frozenset({"eval", "expire", "hset", "hdel", "publish", "xack", "xdel"})
Command = tuple[str, tuple[Any, ...], dict[str, Any]]


class Outbox:
    """Queues write commands with a pipeline's signature (`outbox.hset(key, field, value)`) until flush()."""

    def __init__(self, resend_window_s: float = 0.0) -> None:
        self._commands: list[Command] = []
        self._resend_window_s = resend_window_s
        self._sent: collections.deque[tuple[float, list[Command]]] = collections.deque()

    def __getattr__(self, name: str) -> Any:
        if name not in WRITES:
            raise AttributeError(name)

        def queue(*args: Any, **kwargs: Any) -> Outbox:
            self._commands.append((name, args, kwargs))
            return self

        return queue

    def __len__(self) -> int:
        return len(self._commands)

    def flush(self, client: redis.Redis) -> None:
        """Send everything queued; on a Redis error it all stays queued (and the error propagates)."""
        if not self._commands:
            return
        _send(client, self._commands)
        now = time.monotonic()
        if self._resend_window_s > 0:
            self._sent.append((now, self._commands))
        while self._sent and now - self._sent[0][0] > self._resend_window_s:
            self._sent.popleft()
        self._commands = []

    def resend(self, client: redis.Redis) -> int:
        """Send again what was sent in the last resend_window_s (in its order); how many commands."""
        commands = [command for _, sent in self._sent for command in sent]
        if commands:
            _send(client, commands)
        return len(commands)

    def forget_sent(self) -> None:
        """Nothing sent before is to be sent again (what it was about is gone)."""
        self._sent.clear()

    def clear(self) -> None:
        self._commands.clear()


def _send(client: redis.Redis, commands: list[Command]) -> None:
    pipe = client.pipeline(transaction=False)
    for name, args, kwargs in commands:
        getattr(pipe, name)(*args, **kwargs)
    pipe.execute()
