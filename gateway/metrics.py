"""Prometheus metrics under vLLM's names: latencies measured here, the rest read from heartbeats per scrape.

Under gunicorn, PROMETHEUS_MULTIPROC_DIR (set up by gateway.gunicorn_conf before the workers start)
makes every worker process write its histograms to files that a scrape of any one of them adds up.
Without it (the Flask test client, one process) a plain registry holds them.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable, Iterator
from typing import get_args

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

from gateway.serving.batch_records import BatchProgress, BatchStore
from shared.batches import BatchStatus
from shared.protocol import ITERATION_TOKENS_BUCKETS, QUEUE_TIME_BUCKETS_S, Heartbeat, SchedulerStats
from shared.registry import WorkerRegistry

logger = logging.getLogger(__name__)
disable_created_metrics()  # as vLLM: no `_created` series beside every counter and histogram

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
BATCHES_COUNTED = 1000  # the newest batches a scrape reads, so a scrape costs the same however many are kept
LABELS = ["model_name"]
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0, 600.0)
# Token counts: 1, 2, 5, 10, 20, 50, ... up to past any model's context.
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))
_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)

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
# Deprecated in vLLM for inter_token_latency_seconds, which it equals; kept for dashboards that read it.
TIME_PER_OUTPUT_TOKEN = Histogram(
    "vllm:time_per_output_token_seconds",
    "Time between successive output tokens of a sample (the same as vllm:inter_token_latency_seconds).",
    LABELS,
    buckets=_LATENCY_BUCKETS,
    registry=_local,
)
REQUEST_PROMPT_TOKENS = Histogram(
    "vllm:request_prompt_tokens",
    "Prompt tokens of each finished request.",
    LABELS,
    buckets=_TOKEN_BUCKETS,
    registry=_local,
)
REQUEST_GENERATION_TOKENS = Histogram(
    "vllm:request_generation_tokens",
    "Output tokens of each finished request (all its samples).",
    LABELS,
    buckets=_TOKEN_BUCKETS,
    registry=_local,
)
REQUEST_PARAMS_N = Histogram(
    "vllm:request_params_n", "The n of each finished request.", LABELS, buckets=_N_BUCKETS, registry=_local
)
REQUEST_PARAMS_MAX_TOKENS = Histogram(
    "vllm:request_params_max_tokens",
    "The max_tokens of each finished request (the room left in the context when it gave none).",
    LABELS,
    buckets=_TOKEN_BUCKETS,
    registry=_local,
)
REQUEST_INFERENCE_TIME = Histogram(
    "vllm:request_inference_time_seconds",
    "Time a finished request spent running on its worker: prefill plus decode.",
    LABELS,
    buckets=_E2E_BUCKETS,
    registry=_local,
)
REQUEST_PREFILL_TIME = Histogram(
    "vllm:request_prefill_time_seconds",
    "Time from a request's first scheduled step on its worker to its first token.",
    LABELS,
    buckets=_E2E_BUCKETS,
    registry=_local,
)
REQUEST_DECODE_TIME = Histogram(
    "vllm:request_decode_time_seconds",
    "Time from a request's first token to its last, on its worker (the longest of its samples).",
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


def declare(model_name: str) -> None:
    """Create this process's series of the model (at zero), so a scrape shows them before any request ends."""
    for metric in (
        TIME_TO_FIRST_TOKEN,
        INTER_TOKEN_LATENCY,
        TIME_PER_OUTPUT_TOKEN,
        E2E_REQUEST_LATENCY,
        REQUEST_PROMPT_TOKENS,
        REQUEST_GENERATION_TOKENS,
        REQUEST_PARAMS_N,
        REQUEST_PARAMS_MAX_TOKENS,
        REQUEST_INFERENCE_TIME,
        REQUEST_PREFILL_TIME,
        REQUEST_DECODE_TIME,
    ):
        metric.labels(model_name=model_name)
    for reason in ("stop", "length", "abort"):
        REQUEST_SUCCESS.labels(model_name=model_name, finished_reason=reason)


class _Local:
    """This process's own metrics, as one collector."""

    def collect(self) -> Iterator[Metric]:
        yield from _local.collect()


class ClusterCollector:
    """Worker and scheduler gauges, counters and histograms, read from their heartbeats at scrape time.

    A worker's figures carry its id in the `worker` label and its served model in `model_name`; they lag by
    at most one heartbeat. The scheduler's carry the model of each queue, and the routing counters its own.
    """

    def __init__(self, registry: WorkerRegistry, model_name: str, batches: BatchStore | None = None) -> None:
        self._registry = registry
        self._model_name = model_name
        self._batches = batches

    def collect(self) -> Iterator[Metric]:
        try:
            beats = list(self._registry.read().live.values())
            stats = self._registry.scheduler_stats()
            progress = self._batches.progress(BATCHES_COUNTED) if self._batches else None
        except redis.RedisError as e:
            logger.warning("metrics: Redis unavailable: %s", e)
            return
        yield from self._worker_metrics(beats)
        yield from self._scheduler_metrics(stats, beats)
        if progress is not None:
            yield from _batch_metrics(progress)

    def _worker_metrics(self, beats: list[Heartbeat]) -> Iterator[Metric]:
        labels = ["model_name", "worker"]

        def family(
            kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
            name: str,
            documentation: str,
            value: Callable[[Heartbeat], float],
        ) -> Metric:
            metric = kind(name, documentation, labels=labels)
            for beat in beats:
                metric.add_metric([beat.model, beat.worker_id], value(beat))
            return metric

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield family(
            gauge, "vllm:num_requests_running", "Requests in a worker's batch.", lambda b: b.num_running
        )
        yield family(
            gauge, "vllm:num_requests_waiting", "Requests queued inside a worker.", lambda b: b.num_waiting
        )
        for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):  # the second: vLLM's old name
            yield family(gauge, name, "Fraction of a worker's KV blocks in use (1 = full).", kv_usage)
        yield family(
            counter,
            "vllm:prompt_tokens",
            "Prompt tokens a worker has processed.",
            lambda b: b.prompt_tokens_total,
        )
        yield family(
            counter,
            "vllm:generation_tokens",
            "Tokens a worker has generated.",
            lambda b: b.generation_tokens_total,
        )
        for prefix in ("vllm:", "vllm:gpu_"):  # the second: vLLM's old names
            yield family(
                counter,
                f"{prefix}prefix_cache_queries",
                "Prompt tokens a worker looked up in its prefix cache.",
                lambda b: b.prefix_cache_queries_total,
            )
            yield family(
                counter,
                f"{prefix}prefix_cache_hits",
                "Prompt tokens a worker found in its prefix cache.",
                lambda b: b.prefix_cache_hits_total,
            )
        yield family(
            counter,
            "vllm:num_preemptions",
            "Sequences a worker preempted (freed their blocks, to recompute them later).",
            lambda b: b.num_preemptions,
        )
        yield from _spec_decode_metrics(beats, labels)
        iteration = HistogramMetricFamily(
            "vllm:iteration_tokens_total",
            "Tokens per engine step of a worker: prompt tokens computed plus tokens sampled.",
            labels=labels,
        )
        bounds = [*(str(float(b)) for b in ITERATION_TOKENS_BUCKETS), "+Inf"]
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "A worker's KV cache configuration (in the labels; the value is 1).",
            labels=[*labels, "block_size", "num_gpu_blocks", "cache_dtype", "device", "max_model_len"],
        )
        for beat in beats:
            values = [beat.model, beat.worker_id]
            buckets = list(zip(bounds, (float(c) for c in beat.iteration_tokens_buckets)))
            iteration.add_metric(values, buckets, float(beat.iteration_tokens_sum))
            config = [
                str(beat.block_size),
                str(beat.total_blocks),
                beat.dtype,
                beat.device,
                str(beat.max_model_len),
            ]
            info.add_metric([*values, *config], 1.0)
        yield iteration
        yield info

    def _scheduler_metrics(self, stats: SchedulerStats | None, beats: list[Heartbeat]) -> Iterator[Metric]:
        queued = GaugeMetricFamily(
            "pagedserve:scheduler_num_requests_waiting",
            "Requests queued in the scheduler, not yet assigned to a worker.",
            labels=LABELS,
        )
        waiting = dict(stats.waiting_by_model) if stats else {}
        waiting.setdefault(self._model_name, 0)
        for model, count in sorted(waiting.items()):
            queued.add_metric([model], count)
        live = GaugeMetricFamily(
            "pagedserve:num_live_workers", "Workers with a live heartbeat.", labels=LABELS
        )
        per_model = collections.Counter(beat.model for beat in beats)
        per_model.setdefault(self._model_name, 0)
        for model, count in sorted(per_model.items()):
            live.add_metric([model], count)
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
        yield from (queued, live, queue_time)
        routing = [
            ("routed_prompt_blocks", "Prompt blocks of the requests the scheduler admitted."),
            ("routed_matched_blocks", "Of those, the blocks the chosen worker's prefix cache held."),
            ("kv_events_applied", "KV events of the workers the scheduler's prefix index applied."),
            ("kv_resyncs", "Workers' block sets the prefix index reloaded (at a start, a gap or a reset)."),
        ]
        for field, documentation in routing:
            counter = CounterMetricFamily(f"pagedserve:scheduler_{field}", documentation, labels=LABELS)
            counter.add_metric([self._model_name], getattr(stats, field) if stats else 0)
            yield counter
        index = GaugeMetricFamily(
            "pagedserve:scheduler_prefix_index_blocks",
            "Distinct block hashes the scheduler's prefix index holds.",
            labels=LABELS,
        )
        index.add_metric([self._model_name], stats.prefix_index_blocks if stats else 0)
        yield index


def _batch_metrics(progress: BatchProgress) -> Iterator[Metric]:
    batches = GaugeMetricFamily(
        "pagedserve:batches",
        f"Batches (of the Batch API) by status, of the newest {BATCHES_COUNTED} kept.",
        labels=["status"],
    )
    for status in get_args(BatchStatus):
        batches.add_metric([status], progress.by_status[status])
    lines = GaugeMetricFamily(
        "pagedserve:batch_requests",
        "Requests (input lines) of the batches not yet ended: their total, and those completed or failed.",
        labels=["state"],
    )
    for state in ("total", "completed", "failed"):
        lines.add_metric([state], progress.lines[state])
    yield from (batches, lines)


def kv_usage(beat: Heartbeat) -> float:
    """Fraction of the worker's KV blocks in use (1 = full): the gauge, and the dashboard's figure."""
    return 1.0 - beat.free_blocks / beat.total_blocks if beat.total_blocks else 0.0


def render(registry: WorkerRegistry, model_name: str, batches: BatchStore | None = None) -> tuple[bytes, str]:
    """The exposition text of one scrape, and its content type."""
    collectors = CollectorRegistry(auto_describe=False)
    if os.environ.get(MULTIPROC_ENV):
        MultiProcessCollector(collectors)
    else:
        collectors.register(_Local())  # type: ignore[arg-type]
    collectors.register(ClusterCollector(registry, model_name, batches))  # type: ignore[arg-type]
    return generate_latest(collectors), CONTENT_TYPE_LATEST


def _spec_decode_metrics(beats: list[Heartbeat], labels: list[str]) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters, from the workers that speculate (none when it is off)."""
    speculating = [b for b in beats if b.spec_decode_num_accepted_tokens_per_pos]
    for name, documentation, value in (
        ("vllm:spec_decode_num_drafts", "Verifies of draft tokens a worker ran.", "spec_decode_num_drafts"),
        (
            "vllm:spec_decode_num_draft_tokens",
            "Draft tokens a worker verified.",
            "spec_decode_num_draft_tokens",
        ),
        (
            "vllm:spec_decode_num_accepted_tokens",
            "Draft tokens a worker accepted.",
            "spec_decode_num_accepted_tokens",
        ),
    ):
        metric = CounterMetricFamily(name, documentation, labels=labels)
        for beat in speculating:
            metric.add_metric([beat.model, beat.worker_id], float(getattr(beat, value)))
        yield metric
    per_position = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens a worker accepted, by their position among the drafts (0: the first).",
        labels=[*labels, "position"],
    )
    for beat in speculating:
        for position, count in enumerate(beat.spec_decode_num_accepted_tokens_per_pos):
            per_position.add_metric([beat.model, beat.worker_id, str(position)], float(count))
    yield per_position
