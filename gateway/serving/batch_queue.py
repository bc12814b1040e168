"""The Celery application of the Batch API, as both sides configure it: the gateway queues batches on it, the
batch workers (gateway.batch.worker) run them.

Redis is the broker and the result backend, the same Redis as the rest under the deployment's prefix
(`{prefix}:celery:`). A task is acknowledged only once it has returned (acks_late), and not when it raised
or its worker was lost: a batch task whose Celery worker died, even by kill -9, is delivered again once the
visibility timeout has passed. Messages are JSON, never pickle.
"""

from __future__ import annotations

from urllib.parse import quote

from celery import Celery

from gateway.serving.settings import ClientSettings
from shared.batches import BATCH_QUEUE
from shared.redis_client import is_sentinel_url, parse_sentinel_url

# How often a batch worker looks for tasks whose worker died (past the visibility timeout).
RESTORE_INTERVAL_S = 1


def make_celery(settings: ClientSettings) -> Celery:
    prefix = settings.keys.celery_prefix
    url, sentinel_options = celery_url(settings.redis_url)
    app = Celery("pagedserve", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        broker_transport_options={
            "global_keyprefix": prefix,
            "visibility_timeout": settings.batch_visibility_timeout_s,
            "unacked_restore_interval": RESTORE_INTERVAL_S,
            "unacked_restore_throttle": 1,
            **sentinel_options,
        },
        result_backend_transport_options={"global_keyprefix": prefix, **sentinel_options},
        result_expires=settings.request_ttl_s,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_default_queue=BATCH_QUEUE,
        task_acks_late=True,
        task_acks_on_failure_or_timeout=False,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # a Redis away is waited out, never a reason to exit
        task_track_started=True,
    )
    return app


def celery_url(redis_url: str) -> tuple[str, dict[str, object]]:
    """Celery's broker and backend URL for REDIS_URL, and the transport options a Sentinel URL adds: Celery
    writes Sentinels as `sentinel://HOST:PORT/DB;sentinel://...` with the master's name in the options."""
    if not is_sentinel_url(redis_url):
        return redis_url, {}
    parsed = parse_sentinel_url(redis_url)
    auth = f":{quote(parsed.password, safe='')}@" if parsed.password else ""
    url = ";".join(f"sentinel://{auth}{host}:{port}/{parsed.db}" for host, port in parsed.sentinels)
    options: dict[str, object] = {"master_name": parsed.master}
    if parsed.sentinel_password:
        options["sentinel_kwargs"] = {"password": parsed.sentinel_password}
    return url, options
