"""The scheduler loop: read the requests stream, watch the workers, admit, publish the queue's state."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterable
from typing import Any, cast

import redis

from scheduler_svc.admission import (
    Admit,
    Decision,
    Reject,
    Shape,
    never_fits,
    plan_admissions,
    rooms_of,
    shapes_of,
)
from scheduler_svc.failover import Failover
from scheduler_svc.prefix_index import KVEventReader
from scheduler_svc.queue import ModelQueues, QueuedRequest, QueueTimes
from scheduler_svc.reserve import Reserver
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.workers import WorkerView
from shared.backoff import redis_backoff
from shared.health import StatusReporter
from shared.protocol import Assignment, SchedulerStats, WireError
from shared.records import error_events, push_event
from shared.redis_client import NamedPipeline, connect
from shared.streams import SCHEDULER_GROUP, Fields, ensure_group, read_request, stream_ms

log = logging.getLogger(__name__)

READ_COUNT = 512  # entries per read of the requests stream
STATS_INTERVAL_S = 0.5  # unchanged stats are rewritten this often, well inside their TTL
# An iteration takes a poll interval, or a backoff pause while Redis is away: one older than this is stuck.
LOOP_STALL_S = 60.0
ROUTING_LOG_LEN = 50  # routing decisions kept for the dashboard (all schedulers' together, newest first)
ROUTING_LOG_TTL_S = 600


def default_consumer_name() -> str:
    """Stable per host and process: a container restarted as pid 1 re-reads its own pending entries."""
    return f"{socket.gethostname()}-{os.getpid()}"


StreamEntry = tuple[str, Fields]


class SchedulerService:
    """Admits requests from the requests stream to workers' inboxes and re-queues the work of dead workers."""

    def __init__(
        self, settings: SchedulerSettings, client: redis.Redis | None = None, consumer: str | None = None
    ) -> None:
        self.settings = settings
        self.keys = settings.keys
        self.client = client or connect(settings.redis_url)
        self.consumer = consumer or default_consumer_name()
        self.queue = ModelQueues()
        self.view = WorkerView(self.client, self.keys)
        self.failover = Failover(self.client, self.keys, owner=self.consumer)
        self.reserver = Reserver(
            self.client, self.keys, settings.watermark_blocks, settings.max_running_per_worker
        )
        self.kv = KVEventReader(self.client, self.keys) if settings.routing_policy == "prefix" else None
        self.routed_prompt_blocks = 0
        self.routed_matched_blocks = 0
        self._fresh: list[QueuedRequest] = []  # read this step: checked at once against every worker
        self._needs_resync = True
        self._redis_was_away = False
        self._sweeps_from = 0.0  # monotonic time before which no worker is declared dead (after an outage)
        self._stopping = False
        self._next_claim = 0.0
        self._next_refresh = 0.0
        self._view_stale = False
        self._last_stats: tuple[int, ...] | None = None
        self.queue_times = QueueTimes()
        self._stats_at = 0.0

    def stop(self) -> None:
        self._stopping = True

    def run(self) -> None:
        """Step until stopped; a Redis error costs a pause (with backoff) and a resynchronization, never the
        process."""
        block_ms = max(1, round(self.settings.poll_interval_s * 1000))
        log.info("scheduler %s reading %s", self.consumer, self.keys.requests)
        backoff = redis_backoff(self.settings.redis_url)
        last_iteration = time.monotonic()
        status = StatusReporter(
            self.settings.status_file,
            "scheduler",
            self.consumer,
            state=lambda: "serving",
            alive=lambda: time.monotonic() - last_iteration < LOOP_STALL_S,
        ).start()
        try:
            while not self._stopping:
                last_iteration = time.monotonic()
                try:
                    self.step(block_ms)
                    backoff.reset()
                except redis.RedisError as exc:
                    if backoff.failures == 0:
                        log.warning("Redis unavailable (%s); resynchronizing once it is back", exc)
                    self.redis_lost()
                    time.sleep(backoff.next_delay())
        finally:
            status.stop()
        log.info("scheduler %s stopped", self.consumer)

    def redis_lost(self) -> None:
        """Redis failed a call: resynchronize once it answers, and hold dead-worker sweeps for a heartbeat TTL
        from then. A heartbeat that lapsed while Redis was away, or in a failover to a replica that never got
        the last beats, says nothing of its worker: the worker beats again once it reconnects."""
        self._needs_resync = True
        self._redis_was_away = True

    def step(self, block_ms: int | None = None) -> None:
        """One iteration: claim orphans, read, refresh the workers when due, fail over, admit, publish."""
        if self._needs_resync:
            self._resync()
        if time.monotonic() >= self._next_claim:
            self._claim_orphans()
            self._next_claim = time.monotonic() + self.settings.claim_idle_s / 3
        self._read(">", block_ms)
        now = time.monotonic()
        refreshed = now >= self._next_refresh or self._view_stale
        if refreshed:
            # The view only guides the plan (the admit script checks each worker as it reserves), so it is
            # read again every view_refresh_s, or as soon as a worker refused what the plan sent it.
            self.view.refresh()
            self._next_refresh, self._view_stale = now + self.settings.view_refresh_s, False
            if self.view.dead and now >= self._sweeps_from:
                # The re-queued requests come back through the stream, so they take the normal path next step.
                self.failover.sweep(self.view.dead)
        if self.kv is not None and (refreshed or self.queue):
            self.kv.update(self.view.live.keys())
        self._admit()
        self._publish_stats()

    def _resync(self) -> None:
        """Rebuild from Redis: the group and our own pending entries."""
        ensure_group(self.client, self.keys.requests, SCHEDULER_GROUP)
        if self.kv is not None:
            self.kv.forget_all()  # reloaded from the workers' sets at the next update
        self.queue.clear()
        self._fresh.clear()
        last_id = "0"
        while entries := self._read(last_id, None):
            last_id = entries[-1][0]
        self._needs_resync = False
        if self._redis_was_away:
            self._sweeps_from = time.monotonic() + self.settings.heartbeat_ttl_s
            self._redis_was_away = False
        if self.queue:
            log.info("re-read %d pending requests", len(self.queue))

    def _read(self, from_id: str, block_ms: int | None) -> list[StreamEntry]:
        """One XREADGROUP: ">" for new entries, an id to re-read our own pending ones after it."""
        response = self.client.xreadgroup(
            SCHEDULER_GROUP, self.consumer, {self.keys.requests: from_id}, count=READ_COUNT, block=block_ms
        )
        entries: list[StreamEntry] = []
        # RESP2 (our client's protocol): [[stream, [(id, fields), ...]]], or None after a block with nothing.
        for _stream, stream_entries in cast(list[tuple[str, list[StreamEntry]]], response or []):
            entries.extend(stream_entries)
        self._intake(entries)
        return entries

    def _claim_orphans(self) -> None:
        """Keep our entries fresh, then claim those no scheduler touched for claim_idle_s (one pipeline)."""
        idle_ms = round(self.settings.claim_idle_s * 1000)
        pipe = NamedPipeline(self.client)
        own: list[Any] = self.queue.entry_ids()
        if own:
            # Entries wait here for free blocks as long as they must: re-claiming them to ourselves resets
            # their idle time, so that only a dead scheduler's entries ever look idle.
            pipe.pipe.xclaim(self.keys.requests, SCHEDULER_GROUP, self.consumer, 0, own, justid=True)
        pipe.named("autoclaim").xautoclaim(
            self.keys.requests, SCHEDULER_GROUP, self.consumer, idle_ms, "0-0", count=READ_COUNT
        )
        cursor, claimed, _deleted = pipe.execute()["autoclaim"]
        while True:
            self._intake(claimed)
            if claimed:
                log.info("claimed %d requests of a dead scheduler", len(claimed))
            if cursor == "0-0":
                break
            cursor, claimed, _deleted = self.client.xautoclaim(
                self.keys.requests, SCHEDULER_GROUP, self.consumer, idle_ms, cursor, count=READ_COUNT
            )

    def _intake(self, entries: Iterable[StreamEntry]) -> None:
        """Queue decoded requests; acknowledge and delete entries that can never be decoded."""
        unreadable: list[str] = []
        for entry_id, fields in entries:
            try:
                request = read_request(fields)
            except ValueError as exc:
                log.error("dropping request entry %s: %s", entry_id, exc)
                unreadable.append(entry_id)
                continue
            entry = QueuedRequest(entry_id, request)
            if self.queue.push(entry):
                self._fresh.append(entry)
        if unreadable:
            self._ack(self.client.pipeline(transaction=False), unreadable).execute()

    def _admit(self) -> None:
        """Plan each model's queue against the view of its workers, then at most two round trips: abort
        flags, then one MULTI/EXEC."""
        rooms = self.view.rooms(self.settings.watermark_blocks)
        fresh, self._fresh = self._fresh, []
        matcher = self._matches if self.kv else None
        decisions: list[Decision] = []
        for model, queue in self.queue.queues().items():
            mine = rooms_of(rooms, model)
            decisions += plan_admissions(queue, mine, self.settings.max_running_per_worker, matcher)
        decided = {d.entry.entry_id for d in decisions}
        # Fail a request that fits no worker of its model as soon as it arrives, not once it reaches the head.
        shapes: dict[str, set[Shape]] = {}
        for entry in fresh:
            if entry.entry_id in decided:
                continue
            model = entry.request.model
            if model not in shapes:
                shapes[model] = shapes_of(rooms_of(rooms, model))
            error = never_fits(entry.request, shapes[model])
            if error is not None:
                decisions.append(Reject(entry, error))
        if decisions:
            self._commit(decisions)

    def _matches(self, entry: QueuedRequest, block_size: int) -> dict[str, int]:
        assert self.kv is not None
        return self.kv.index.matches(entry.prompt_hashes(block_size))

    def _commit(self, decisions: list[Decision]) -> None:
        """Hand admitted requests on (the admit script reserves, queues and acknowledges each atomically) and
        answer rejected ones, in one round trip."""
        keys = self.keys
        admits = [d for d in decisions if isinstance(d, Admit)]
        rejects = [d for d in decisions if isinstance(d, Reject)]
        aborted: set[str] = set()
        if admits:
            flags = NamedPipeline(self.client)
            for admit in admits:
                flags.named(admit.entry.entry_id).exists(keys.abort_flag(admit.entry.request.request_id))
            aborted = {str(entry_id) for entry_id, flag in flags.execute().items() if flag}
        sent = [a for a in admits if a.entry.entry_id not in aborted]
        pipe = NamedPipeline(self.client)
        for admit in sent:
            assignment = Assignment(
                worker_id=admit.worker_id, request=admit.entry.request, reserved_blocks=admit.reserved_blocks
            )
            self.reserver.admit(pipe.named(admit.entry.entry_id), assignment, admit.entry.entry_id)
        for reject in rejects:
            for event in error_events(reject.entry.request, WireError.of(reject.error), "scheduler"):
                push_event(pipe.pipe, keys, event, self.settings.request_ttl_s)
        handled = [d.entry.entry_id for d in decisions if not isinstance(d, Admit)] + sorted(aborted)
        if handled:
            self._ack(pipe.pipe, handled)
        inbox_entry_ids = pipe.execute()
        taken = [a for a in sent if inbox_entry_ids[a.entry.entry_id] is not None]
        if taken:
            self._log_routes(taken[-ROUTING_LOG_LEN:])
        for admit in taken:
            self.view.record_assignment(admit.worker_id, admit.reserved_blocks)
            waited_ms = stream_ms(inbox_entry_ids[admit.entry.entry_id]) - stream_ms(admit.entry.entry_id)
            self.queue_times.observe(max(0, waited_ms) / 1000)
            self.routed_prompt_blocks += admit.prompt_blocks
            self.routed_matched_blocks += admit.matched_blocks
            log.debug(
                "assigned %s to %s: %d of %d prompt blocks held, %d reserved, score %.3f (next %s, %.3f)",
                admit.entry.request.request_id,
                admit.worker_id,
                admit.matched_blocks,
                admit.prompt_blocks,
                admit.reserved_blocks,
                admit.score,
                admit.runner_up,
                admit.runner_up_score,
            )
        for admit in sent:
            if inbox_entry_ids[admit.entry.entry_id] is None:
                # Another scheduler took the blocks first: it waits for the next round.
                log.debug(
                    "worker %s had no room left for %s", admit.worker_id, admit.entry.request.request_id
                )
        for admit in admits:
            if admit.entry.entry_id in aborted:
                log.info("dropped aborted request %s", admit.entry.request.request_id)
        for reject in rejects:
            log.info("rejected request %s: %s", reject.entry.request.request_id, reject.error)
        self.queue.remove(handled + [a.entry.entry_id for a in taken])

    def _log_routes(self, admits: list[Admit]) -> None:
        """The round's latest decisions on the capped routing log the dashboard reads (one round trip)."""
        now = time.time()
        routes = [
            json.dumps(
                {
                    "at": now,
                    "request_id": a.entry.request.request_id,
                    "model": a.entry.request.model,
                    "worker_id": a.worker_id,
                    "matched_blocks": a.matched_blocks,
                    "prompt_blocks": a.prompt_blocks,
                    "score": round(a.score, 4),
                    "runner_up": a.runner_up,
                    "policy": self.settings.routing_policy,
                }
            )
            for a in admits
        ]
        pipe = self.client.pipeline(transaction=False)
        pipe.lpush(self.keys.routing_log, *routes)
        pipe.ltrim(self.keys.routing_log, 0, ROUTING_LOG_LEN - 1)
        pipe.expire(self.keys.routing_log, ROUTING_LOG_TTL_S)  # gone a while after the last scheduler stops
        pipe.execute()

    def _ack(self, pipe: redis.client.Pipeline, entry_ids: list[str]) -> redis.client.Pipeline:
        """Acknowledge and delete handled entries (deleting keeps the stream short; none is read again)."""
        pipe.xack(self.keys.requests, SCHEDULER_GROUP, *entry_ids)
        pipe.xdel(self.keys.requests, *entry_ids)
        return pipe

    def _publish_stats(self) -> None:
        """Write the stats hash when they change, and at least every STATS_INTERVAL_S (one round trip)."""
        kv = self.kv
        current = (
            len(self.queue),
            self.view.num_assigned,
            self.queue_times.count,
            kv.num_events if kv else 0,
            kv.num_resyncs if kv else 0,
        )
        now = time.monotonic()
        if current == self._last_stats and now - self._stats_at < STATS_INTERVAL_S:
            return
        stats = SchedulerStats(
            num_waiting=current[0],
            num_assigned=current[1],
            updated_at=time.time(),
            queue_time_buckets=list(self.queue_times.buckets),
            queue_time_sum_s=self.queue_times.sum_s,
            waiting_by_model=self.queue.waiting_by_model(),
            routing_policy=self.settings.routing_policy,
            routed_prompt_blocks=self.routed_prompt_blocks,
            routed_matched_blocks=self.routed_matched_blocks,
            kv_events_applied=kv.num_events if kv else 0,
            kv_resyncs=kv.num_resyncs if kv else 0,
            prefix_index_blocks=len(kv.index) if kv else 0,
        )
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.keys.scheduler_stats, mapping=cast(dict[Any, Any], stats.to_hash()))
        pipe.pexpire(self.keys.scheduler_stats, round(self.settings.heartbeat_ttl_s * 1000))
        pipe.execute()
        self._last_stats, self._stats_at = current, now
