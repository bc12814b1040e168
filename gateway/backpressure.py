"""Back-pressure: a request is queued only while some worker is live and the scheduler's queue is not full."""

from __future__ import annotations

from gateway.serving.errors import APIError
from shared.errors import ErrorCode
from shared.registry import WorkerRegistry

FULL_QUEUE_RETRY_AFTER_S = 1.0


def check_backpressure(
    registry: WorkerRegistry, max_queue_len: int, no_worker_retry_after_s: float, num_requests: int = 1
) -> None:
    """Raises a 503 (with Retry-After) when the queue has no room for num_requests or no worker is live."""
    stats = registry.scheduler_stats()
    if stats is not None and stats.num_waiting + num_requests > max_queue_len:
        raise APIError(
            ErrorCode.OVERLOADED,
            f"the server is overloaded ({stats.num_waiting} requests waiting); retry later",
            retry_after=FULL_QUEUE_RETRY_AFTER_S,
        )
    if not registry.live_worker_ids():
        raise APIError(
            ErrorCode.NO_WORKER,
            "no inference worker is available; retry later",
            retry_after=no_worker_retry_after_s,
        )
