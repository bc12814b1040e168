"""The worker's writes to Redis, queued during one loop iteration and sent together.

Sent as one MULTI/EXEC, so a Redis that goes away mid-send applies all of them or none; they stay queued until
they have been sent, and the worker steps its engine only with an empty outbox, so what a client is owed is
never lost to an outage (unless Redis itself comes back without the request).
"""

from __future__ import annotations

from typing import Any

import redis

# The commands the worker queues (token records, events, assignment and inbox bookkeeping).
WRITES = frozenset({"rpush", "expire", "hset", "hdel", "publish", "xack", "xdel"})


class Outbox:
    """Queues write commands with a pipeline's signature (`outbox.rpush(key, *values)`) until flush()."""

    def __init__(self) -> None:
        self._commands: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

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
        pipe = client.pipeline(transaction=True)
        for name, args, kwargs in self._commands:
            getattr(pipe, name)(*args, **kwargs)
        pipe.execute()
        self._commands.clear()

    def clear(self) -> None:
        self._commands.clear()
