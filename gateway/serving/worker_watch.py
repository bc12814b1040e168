"""Whether any worker of the served model is live, as one gateway process sees it, for the requests it holds
in flight."""

from __future__ import annotations

import time

import redis

from shared.registry import WorkerRegistry

REFRESH_S = 1.0


class WorkerWatch:
    """Reads the registry at most once per REFRESH_S for all the process's requests, and says for how long
    no worker has been live (a Redis that cannot be read says nothing either way)."""

    def __init__(
        self, registry: WorkerRegistry, model: str | None = None, refresh_s: float = REFRESH_S
    ) -> None:
        self._registry = registry
        self._model = model
        self._refresh_s = refresh_s
        self._checked_at = -refresh_s
        self._none_since: float | None = None

    def seconds_without_worker(self) -> float:
        now = time.monotonic()
        if now - self._checked_at >= self._refresh_s:
            self._checked_at = now
            try:
                live = bool(self._registry.live_worker_ids(self._model))
            except redis.RedisError:
                return 0.0
            if live:
                self._none_since = None
            elif self._none_since is None:
                self._none_since = now
        return 0.0 if self._none_since is None else now - self._none_since
