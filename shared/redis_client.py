"""The one way services open Redis, and pipelines whose replies are read by name.

Every client decodes replies to `str` (keys, hash fields, stream ids and pub/sub payloads alike), so no code
juggles bytes and str.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import redis

CONNECT_TIMEOUT_S = 5.0
# Longer than any blocking read a service issues (those wait well under a second), so it only fires when a
# connection is stuck.
READ_TIMEOUT_S = 30.0
HEALTH_CHECK_INTERVAL_S = 30


def connect(url: str, max_connections: int | None = None, **options: Any) -> redis.Redis:
    """A client (one connection pool) for url, replies decoded to str; options override the defaults.

    With max_connections, a command that finds every connection busy waits for one (up to the read timeout)
    instead of failing: what a process serving many requests at once needs.
    """
    settings: dict[str, Any] = {
        "decode_responses": True,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": READ_TIMEOUT_S,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        **options,
    }
    if max_connections is None:
        return redis.Redis.from_url(url, **settings)
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=READ_TIMEOUT_S, **settings
    )
    return redis.Redis(connection_pool=pool)


class NamedPipeline:
    """A pipeline whose replies are read back by the name each command was queued under, not by position.

    `pipe.named(("inbox", rid)).xadd(...)` queues one command; `execute()` maps every name to its reply.
    Commands queued on `pipe.pipe` directly run too, unnamed: adding one never shifts another's reply.
    """

    def __init__(self, client: redis.Redis, *, transaction: bool = False) -> None:
        self.pipe = client.pipeline(transaction=transaction)
        self._positions: dict[Hashable, int] = {}

    def named(self, name: Hashable) -> redis.client.Pipeline:
        """The pipeline, on which to queue the one command whose reply is read back as name."""
        assert name not in self._positions, f"two commands named {name!r}"
        self._positions[name] = len(self.pipe)
        return self.pipe

    def execute(self) -> dict[Hashable, Any]:
        replies = self.pipe.execute() if len(self.pipe) else []
        return {name: replies[position] for name, position in self._positions.items()}
