"""Back-pressure: a request is queued only while a worker of its model is live and the model's queue in the
scheduler is not full."""

from __future__ import annotations

from gateway.serving.errors import APIError
from shared.errors import ErrorCode
from shared.registry import WorkerRegistry

FULL_QUEUE_RETRY_AFTER_S = 1.0


def check_backpressure(
    registry: WorkerRegistry,
    model: str,
    max_queue_len: int,
    no_worker_retry_after_s: float,
    num_requests: int = 1,
) -> None:
    """Raises a 503 (with Retry-After) when the model's queue has no room for num_requests or no worker of
    the model is live."""
    stats = registry.scheduler_stats()
    waiting = stats.waiting_by_model.get(model, 0) if stats is not None else 0
    if waiting + num_requests > max_queue_len:
        raise APIError(
            ErrorCode.OVERLOADED,
            f"the server is overloaded ({waiting} requests waiting for {model}); retry later",
            retry_after=FULL_QUEUE_RETRY_AFTER_S,
        )
    if not registry.live_worker_ids(model):
        raise APIError(
            ErrorCode.NO_WORKER,
            "no inference worker is available; retry later",
            retry_after=no_worker_retry_after_s,
        )
