"""Waiting between attempts to reach Redis again: exponential, capped, with jitter."""

from __future__ import annotations

import random

from shared.redis_client import is_sentinel_url

FIRST_DELAY_S = 0.1
MAX_DELAY_S = 2.0
# Under Sentinel a lost master is replaced within seconds (down-after plus about a second), and asking the
# Sentinels costs little: the services look again at least this often.
SENTINEL_MAX_DELAY_S = 0.5


class Backoff:
    """Delays that double from first_s up to max_s; each is drawn from its upper half, so that processes
    that lost Redis together do not all come back at the same instant."""

    def __init__(self, first_s: float = FIRST_DELAY_S, max_s: float = MAX_DELAY_S) -> None:
        self._first_s = first_s
        self._max_s = max_s
        self._next_s = first_s
        self.failures = 0  # since the last success

    def next_delay(self) -> float:
        delay = self._next_s * random.uniform(0.5, 1.0)
        self._next_s = min(2 * self._next_s, self._max_s)
        self.failures += 1
        return delay

    def reset(self) -> None:
        self._next_s = self._first_s
        self.failures = 0


def redis_backoff(redis_url: str) -> Backoff:
    """The backoff a service waits with between attempts to reach the Redis of redis_url."""
    return Backoff(max_s=SENTINEL_MAX_DELAY_S if is_sentinel_url(redis_url) else MAX_DELAY_S)
