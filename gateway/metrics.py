"""Prometheus metrics under vLLM's names: latencies measured here, the rest read from heartbeats per scrape.

Under gunicorn, PROMETHEUS_MULTIPROC_DIR (set up by gateway.gunicorn_conf before the workers start)
makes every worker process write its histograms to files that a scrape of any one of them adds up.
Without it (the Flask test client, one process) a plain registry holds them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import redis
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from shared.protocol import QUEUE_TIME_BUCKETS_S
from shared.registry import WorkerRegistry

logger = logging.getLogger(__name__)
disable_created_metrics()  # as vLLM: no `_created` series beside every counter and histogram

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LABELS = ["model_name"]
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0, 600.0)

# Measured in this process; exposed from here alone, or summed over processes from the multiprocess files.
_local = CollectorRegistry(auto_describe=True)
TIME_TO_FIRST_TOKEN = Histogram(
    "vllm:time_to_first_token_seconds",
    "Time from the request's arrival at the gateway to its first output token.",
    LABELS,
    buckets=_LATENCY_BUCKETS,
    registry=_local,
)
INTER_TOKEN_LATENCY = Histogram(
    "vllm:inter_token_latency_seconds",
    "Time between successive output tokens of a sample, as the gateway receives them.",
    LABELS,
    buckets=_LATENCY_BUCKETS,
    registry=_local,
)
E2E_REQUEST_LATENCY = Histogram(
    "vllm:e2e_request_latency_seconds",
    "Time from the request's arrival at the gateway to its last output token.",
    LABELS,
    buckets=_E2E_BUCKETS,
    registry=_local,
)
REQUEST_SUCCESS = Counter(
    "vllm:request_success",
    "Requests that finished, by the finish reason of their samples.",
    [*LABELS, "finished_reason"],
    registry=_local,
)


class _Local:
    """This process's own metrics, as one collector."""

    def collect(self) -> Iterator[Metric]:
        yield from _local.collect()


class ClusterCollector:
    """Worker and scheduler gauges and counters, read from their heartbeats at scrape time."""

    def __init__(self, registry: WorkerRegistry, model_name: str) -> None:
        self._registry = registry
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        try:
            beats = list(self._registry.read().live.values())
            stats = self._registry.scheduler_stats()
        except redis.RedisError as e:
            logger.warning("metrics: Redis unavailable: %s", e)
            return
        labels = ["model_name", "worker"]
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Requests in a worker's batch.", labels=labels
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests queued inside a worker.", labels=labels
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "Fraction of a worker's KV blocks in use (1 = full).", labels=labels
        )
        prompt = CounterMetricFamily(
            "vllm:prompt_tokens", "Prompt tokens a worker has processed.", labels=labels
        )
        generation = CounterMetricFamily(
            "vllm:generation_tokens", "Tokens a worker has generated.", labels=labels
        )
        for beat in beats:
            values = [self._model_name, beat.worker_id]
            running.add_metric(values, beat.num_running)
            waiting.add_metric(values, beat.num_waiting)
            usage.add_metric(values, 1.0 - beat.free_blocks / beat.total_blocks if beat.total_blocks else 0.0)
            prompt.add_metric(values, beat.prompt_tokens_total)
            generation.add_metric(values, beat.generation_tokens_total)
        queued = GaugeMetricFamily(
            "pagedserve:scheduler_num_requests_waiting",
            "Requests queued in the scheduler, not yet assigned to a worker.",
            labels=LABELS,
        )
        queued.add_metric([self._model_name], stats.num_waiting if stats else 0)
        live = GaugeMetricFamily(
            "pagedserve:num_live_workers", "Workers with a live heartbeat.", labels=LABELS
        )
        live.add_metric([self._model_name], len(beats))
        queue_time = HistogramMetricFamily(
            "vllm:request_queue_time_seconds",
            "Time from a request's entry in the requests stream to its worker's inbox (by Redis's clock).",
            labels=LABELS,
        )
        if stats is not None:
            bounds = [*(str(b) for b in QUEUE_TIME_BUCKETS_S), "+Inf"]
            queue_time.add_metric(
                [self._model_name], list(zip(bounds, stats.queue_time_buckets)), stats.queue_time_sum_s
            )
        yield from (running, waiting, usage, prompt, generation, queued, live, queue_time)


def render(registry: WorkerRegistry, model_name: str) -> tuple[bytes, str]:
    """The exposition text of one scrape, and its content type."""
    collectors = CollectorRegistry(auto_describe=False)
    if os.environ.get(MULTIPROC_ENV):
        MultiProcessCollector(collectors)
    else:
        collectors.register(_Local())  # type: ignore[arg-type]
    collectors.register(ClusterCollector(registry, model_name))  # type: ignore[arg-type]
    return generate_latest(collectors), CONTENT_TYPE_LATEST
