"""The batch worker's side of the Celery app: the task that runs a batch, one slice per task.

`python -m gateway.batch` starts a Celery worker on this module; Celery's own tools reach it the same way,
with the same environment: `celery -A gateway.batch.worker inspect active`.
"""

from __future__ import annotations

import logging
import threading

import redis

from gateway.batch.lines import LineContext
from gateway.batch.runner import LEASE_S, BatchRunner
from gateway.batch.settings import BatchSettings
from gateway.serving.batch_files import FileStore
from gateway.serving.batch_queue import make_celery
from gateway.serving.batch_records import BatchStore
from gateway.serving.event_hub import EventHub
from gateway.serving.file_storage import storage_at
from gateway.serving.generation import Limits
from gateway.serving.models import ServedModels
from shared.batches import RUN_BATCH_TASK
from shared.errors import ErrorCode
from shared.redis_client import connect
from shared.registry import WorkerRegistry

logger = logging.getLogger(__name__)

# A batch's lines wait this long at most between looks at their requests (their deadline, the workers).
TICK_S = 1.0

settings = BatchSettings.model_validate({})
app = make_celery(settings)

_runner: BatchRunner | None = None
_runner_lock = threading.Lock()


def runner() -> BatchRunner:
    """The process's runner, built at its first batch (the tokenizer loads once per process)."""
    global _runner
    with _runner_lock:
        if _runner is None:
            _runner = build_runner(settings)
        return _runner


def build_runner(settings: BatchSettings) -> BatchRunner:
    keys = settings.keys
    client = connect(settings.redis_url, client_name=f"{settings.redis_prefix}:batch")
    limits = Limits.of(settings, tick_s=TICK_S)
    store = BatchStore(client, keys, settings.batch_retention_s)
    ctx = LineContext(
        client=client,
        store=store,
        models=ServedModels(settings, WorkerRegistry(client, keys)),
        hub=EventHub(client),
        limits=limits,
        priority=settings.batch_priority,
    )
    files = FileStore(client, keys, storage_at(settings.batch_storage_dir))
    return BatchRunner(
        ctx, files, lines_in_flight=settings.batch_lines_in_flight, slice_s=settings.batch_slice_s
    )


@app.task(name=RUN_BATCH_TASK)
def run_batch(batch_id: str) -> str:
    """One slice of a batch; the next slice is queued before this one is acknowledged."""
    try:
        outcome = runner().run(batch_id)
    except redis.RedisError as e:
        logger.warning("batch %s: Redis failed (%s); it runs again shortly", batch_id, e)
        outcome = "busy"
    except Exception:
        logger.exception("batch %s failed", batch_id)
        runner().fail(batch_id, ErrorCode.INTERNAL_ERROR, "the batch failed on an internal error")
        outcome = "ended"
    if outcome == "handover":
        app.send_task(RUN_BATCH_TASK, args=[batch_id])
    elif outcome == "busy":
        # (well within the visibility timeout: a task waiting for its countdown is not yet acknowledged)
        app.send_task(RUN_BATCH_TASK, args=[batch_id], countdown=LEASE_S / 2)
    return outcome
