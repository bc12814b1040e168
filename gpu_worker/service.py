"""The worker service: an engine fed from this worker's Redis inbox, publishing tokens after every step."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from typing import Any

import pydantic
import redis

from gpu_worker.assignments import read_assignment, salvage_request, unread_request_ids
from gpu_worker.engine.llm_engine import LLMEngine
from gpu_worker.kv_publisher import KVPublisher
from gpu_worker.outbox import Outbox
from gpu_worker.request_table import ActiveRequest, RequestTable
from gpu_worker.settings import WorkerSettings, engine_config
from shared.backoff import redis_backoff
from shared.errors import CodedError, ErrorCode
from shared.health import StatusReporter
from shared.kv_map import encode_states
from shared.protocol import (
    AbortMessage,
    Assignment,
    Heartbeat,
    WireError,
    decode,
)
from shared.redis_client import NamedPipeline, connect
from shared.reservations import RECOUNT_SCRIPT, give_back
from shared.streams import WORKER_GROUP, ensure_group, next_stream_id, parse_stream_id, read_inbox_entry

logger = logging.getLogger(__name__)

INBOX_READ_COUNT = 64  # inbox entries taken per read
IDLE_BLOCK_MS = 100  # how long an idle worker waits on its inbox before looking at aborts and heartbeats
# A step running longer than this is taken as hung: the heartbeat is no longer kept alive, the worker is
# declared dead and its requests move on. Far above any real step (a 2048-token CPU prefill takes seconds).
MAX_STEP_S = 300.0


class WorkerService:
    """One process per accelerator: registers, heartbeats, runs engine steps, publishes tokens."""

    def __init__(self, settings: WorkerSettings, engine: LLMEngine | None = None) -> None:
        self.settings = settings
        self.keys = settings.keys
        self.worker_id = settings.worker_id
        self.redis = connect(settings.redis_url)
        self.engine = engine or LLMEngine(
            settings.model, engine_config(settings), dtype=settings.dtype, device=settings.device
        )
        self.model_name = settings.served_model_name  # the scheduler sends it requests for this model only
        self.inbox_last_id = "0-0"
        self.started_at = time.time()
        self.last_step_time = 0.0
        self.last_heartbeat = 0.0
        self.stopping = False
        self.draining_since: float | None = None  # monotonic time of the SIGTERM that began a drain
        self.drain_announced = False  # a heartbeat has said so: the admit script sends nothing new
        self.step_started: float | None = None  # monotonic start of the step in progress
        self._keep_alive_stop = threading.Event()
        self._stopped = threading.Event()  # set by SIGTERM/SIGINT: cuts a backoff wait short
        self.aborts = self.redis.pubsub(ignore_subscribe_messages=True)
        self.outbox = Outbox(settings.resend_window_s)
        self.table = RequestTable(self.engine, self.outbox, self.keys, self.worker_id, settings.request_ttl_s)
        self.kv = KVPublisher(self.redis, self.keys, self.worker_id, self.engine.allocator)
        self.registered = False
        self.registered_once = False
        self._recount = self.redis.register_script(RECOUNT_SCRIPT)
        self._taken_blocks = 0  # reserved for assignments taken in since the last heartbeat
        self._backoff = redis_backoff(settings.redis_url)

    @property
    def active(self) -> dict[str, ActiveRequest]:
        return self.table.active

    # -- lifecycle ----------------------------------------------------------------------------------

    def register(self) -> None:
        """Join (or rejoin, after Redis was away): inbox group, abort channel, heartbeat.

        An inbox that is gone while requests run here means the scheduler declared this worker dead and
        re-queued them, or Redis came back empty: either way they are no longer this worker's to finish.
        """
        if not self.redis.exists(self.keys.inbox(self.worker_id)):
            self._taken_blocks = 0  # its reservation counter went with it
            self.outbox.forget_sent()
            if self.active:
                self._drop_all("its inbox is gone (declared dead, or Redis lost its data)")
        elif self.registered_once:
            self._repair()
        self.registered_once = True
        self._create_group()
        self.aborts.close()
        self.aborts = self.redis.pubsub(ignore_subscribe_messages=True)
        self.aborts.subscribe(self.keys.aborts)
        self._apply_abort_flags()  # aborts published while Redis was away were missed
        self.kv.rewrite()  # a KV event may have been lost while Redis was away
        self.heartbeat()
        self.registered = True
        logger.info("worker %s ready: %d KV blocks", self.worker_id, self.engine.allocator.num_blocks)

    def _repair(self) -> None:
        """Redis is back after an error, with this worker's inbox: make it hold what this worker wrote.

        A failover may have promoted a replica that lacks the newest writes of every service. What this
        worker wrote lately is written again (the outbox keeps it, shared.records makes it idempotent); a
        request it runs whose assignment the new master lacks was assigned after the last write the replica
        got, so the scheduler assigns it again from the requests stream and it is dropped here; and the
        reservation counter is recounted from the inbox (shared.reservations). An assignment of a request
        that ended here while its writes were lost (its HDEL among them) would hold a place on this worker
        for ever: the hash keeps only what runs here or waits unread in the inbox.
        """
        resent = self.outbox.resend(self.redis)
        assigned_key = self.keys.assigned(self.worker_id)
        read = NamedPipeline(self.redis)
        # The admit script adds an assignment and its inbox entry at once: one added after the first read
        # is in neither reply, one added before it is in both.
        read.named("assigned").hkeys(assigned_key)
        read.named("unread").xrange(self.keys.inbox(self.worker_id), min=f"({self.inbox_last_id}")
        replies = read.execute()
        assigned = set(replies["assigned"])
        lost = [rid for rid in self.active if rid not in assigned]
        for rid in lost:
            self.table.drop(rid)
        stale = assigned - set(self.active) - unread_request_ids(replies["unread"])
        if stale:
            self.redis.hdel(assigned_key, *stale)
        self._recount(
            keys=[self.keys.inbox(self.worker_id), self.keys.reserved(self.worker_id)],
            args=[self.inbox_last_id],
        )
        self._taken_blocks = 0
        if resent or lost or stale:
            logger.warning(
                "worker %s: Redis was away; wrote %d commands again, dropped %d requests it no longer holds, "
                "removed %d assignments of requests it no longer runs",
                self.worker_id,
                resent,
                len(lost),
                len(stale),
            )

    def _create_group(self) -> None:
        ensure_group(self.redis, self.keys.inbox(self.worker_id), WORKER_GROUP)

    def keep_alive(self) -> None:
        """Extend the heartbeat's TTL every interval, also while a step outlasts it (a long CPU prefill).

        Runs on its own thread; the full heartbeat still comes from the loop between steps. EXPIRE never
        recreates a heartbeat the scheduler has removed, and a step past MAX_STEP_S is left to expire.
        """
        key = self.keys.worker(self.worker_id)
        ttl = max(1, int(self.settings.heartbeat_ttl_s + 0.999))
        while not self._keep_alive_stop.wait(self.settings.heartbeat_interval_s):
            if not self.step_alive():
                continue
            try:
                self.redis.expire(key, ttl)
            except redis.RedisError as e:  # the loop's own heartbeat reports a Redis that stays away
                logger.debug("keep-alive failed: %s", e)

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT (run from the main thread)."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.serve()

    def serve(self) -> None:
        """Serve until stop(); then drop the heartbeat so the scheduler re-queues our requests.

        Redis going away never ends the process: the loop waits (with backoff) and registers again.
        """
        keeper = threading.Thread(target=self.keep_alive, name="keep-alive", daemon=True)
        keeper.start()
        status = StatusReporter(
            self.settings.status_file,
            "worker",
            self.worker_id,
            state=lambda: "serving" if self.draining_since is None else "draining",
            alive=self.step_alive,
        ).start()
        try:
            while not self.stopping:
                try:
                    if not self.registered:
                        self.register()
                    self.run_once()
                    self._backoff.reset()
                except redis.RedisError as e:
                    self._wait_for_redis(e)
        finally:
            self._keep_alive_stop.set()
            keeper.join()
            status.stop()
            with contextlib.suppress(redis.RedisError):
                self.redis.delete(self.keys.worker(self.worker_id))
            self.aborts.close()

    def stop(self) -> None:
        self.stopping = True
        self._stopped.set()

    def drain(self) -> None:
        """Stop taking requests and finish those held, for up to drain_timeout_s; then stop (the rest move on
        to other workers, as from any worker that stops)."""
        if self.draining_since is None and self.settings.drain_timeout_s > 0:
            self.draining_since = time.monotonic()
        else:
            self.stop()

    def step_alive(self) -> bool:
        """False once a step has run past MAX_STEP_S (taken as hung)."""
        started = self.step_started
        return started is None or time.monotonic() - started <= MAX_STEP_S

    def _wait_for_redis(self, error: redis.RedisError) -> None:
        if self._backoff.failures == 0:
            logger.warning(
                "Redis unavailable (%s); holding %d unsent writes, reconnecting", error, len(self.outbox)
            )
        self.registered = False
        since = self.draining_since
        if since is not None and time.monotonic() - since >= self.settings.drain_timeout_s:
            self.stop()  # a drain does not wait on a Redis that stays away
        self._stopped.wait(self._backoff.next_delay())

    def _on_signal(self, signum: int, frame: Any) -> None:
        """The first SIGTERM drains; a second one, or SIGINT, stops at once."""
        if signum == signal.SIGTERM:
            self.drain()
        else:
            self.stop()

    def run_once(self) -> None:
        """Take new work and aborts, run one engine step, publish its tokens; heartbeat when due.

        What an earlier iteration could not send goes first: the engine steps only once it has.
        """
        self.outbox.flush(self.redis)
        busy = self.engine.has_unfinished_requests()
        taken = self._read_inbox(block_ms=None if busy else IDLE_BLOCK_MS)
        self._apply_aborts()
        if self.engine.has_unfinished_requests():
            self.step_started = time.monotonic()
            try:
                seqs = self.engine.step()
            except Exception:
                logger.exception("engine step failed; failing every active request")
                self.table.fail_all(
                    WireError(
                        code=ErrorCode.ENGINE_ERROR, message="the engine failed while running this request"
                    )
                )
            else:
                self.last_step_time = time.time()
                self.table.publish(seqs)
            finally:
                self.step_started = None
        self.kv.publish()  # before the tokens: a request seen finished is in the index the scheduler reads
        self.outbox.flush(self.redis)
        if taken or time.monotonic() - self.last_heartbeat >= self.settings.heartbeat_interval_s:
            self.heartbeat()
        if self.draining_since is not None:
            self._drain_step(taken, self.draining_since)

    def _drain_step(self, taken: int, since: float) -> None:
        """Announce the drain; stop once a read after the announcement found nothing and nothing is held, or
        when drain_timeout_s has passed."""
        if not self.drain_announced:
            self.heartbeat()  # draining: from here on the admit script refuses this worker
            self.drain_announced = True
            logger.info(
                "draining: %d requests held, up to %.0fs", len(self.active), self.settings.drain_timeout_s
            )
            return
        if not taken and not self.engine.has_unfinished_requests() and not self.active and not self.outbox:
            logger.info("drained: every request finished")
            self.stop()
        elif time.monotonic() - since >= self.settings.drain_timeout_s:
            logger.warning("drain timed out: handing %d requests to other workers", len(self.active))
            self.stop()

    # -- inbox and aborts ---------------------------------------------------------------------------

    def _read_inbox(self, block_ms: int | None) -> int:
        """Start new assignments; one that cannot be read or started is answered with an error."""
        inbox = self.keys.inbox(self.worker_id)
        try:
            reply: Any = self.redis.xreadgroup(
                WORKER_GROUP, self.worker_id, {inbox: ">"}, count=INBOX_READ_COUNT, block=block_ms
            )
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._rejoin()
            return 0
        entries: list[tuple[str, str | None]] = []
        seen: list[str] = []
        last_taken = parse_stream_id(self.inbox_last_id)
        for _, messages in reply or []:
            for entry_id, fields in messages:
                if parse_stream_id(entry_id) <= last_taken:
                    # Taken in before a failover whose new master had not heard of it: not run twice.
                    seen.append(entry_id)
                    continue
                data, blocks = read_inbox_entry(fields)
                entries.append((entry_id, data))
                # Reserved for it by the scheduler: given back by the heartbeat that counts it (heartbeat()).
                self._taken_blocks += blocks
        if seen:
            self.outbox.xack(inbox, WORKER_GROUP, *seen)
        if not entries:
            return 0
        assignments: dict[str, Assignment] = {}
        for entry_id, data in entries:
            try:
                assignments[entry_id] = read_assignment(data)
            except CodedError as e:
                self._refuse_unreadable(entry_id, data, e)
        flags = NamedPipeline(self.redis)
        for entry_id, a in assignments.items():
            flags.named(entry_id).exists(self.keys.abort_flag(a.request.request_id))
        aborted = flags.execute()
        for entry_id, assignment in assignments.items():
            if aborted[entry_id]:
                self.outbox.hdel(self.keys.assigned(self.worker_id), assignment.request.request_id)
            else:
                self.table.start(assignment.request)
        # Handed on to the engine: from here a failure is recovered through the assigned hash, not the inbox
        # (whose taken entries the next heartbeat trims).
        self.outbox.xack(inbox, WORKER_GROUP, *[entry_id for entry_id, _ in entries])
        self.inbox_last_id = entries[-1][0]
        return len(entries)

    def _refuse_unreadable(self, entry_id: str, data: str | None, error: CodedError) -> None:
        request = salvage_request(data)
        logger.error(
            "inbox entry %s (request %s): %s", entry_id, request.request_id if request else "unknown", error
        )
        if request is not None and request.request_id not in self.active:
            self.table.finish_with_error(request, WireError.of(error))

    def _drop_all(self, why: str) -> None:
        self.table.drop_all(why)
        self.outbox.clear()

    def _rejoin(self) -> None:
        """The scheduler took this worker for dead and re-queued its requests: drop them, register again."""
        self._drop_all("it was declared dead (its heartbeat lapsed)")
        self._taken_blocks = 0
        self._create_group()
        self.heartbeat()

    def _apply_aborts(self) -> None:
        while True:
            message = self.aborts.get_message(timeout=0)
            if message is None:
                return
            if message.get("type") != "message":
                continue
            try:
                abort = decode(AbortMessage, message["data"])
            except pydantic.ValidationError as e:
                logger.error("dropped an unreadable abort message: %s", e)
                continue
            self.table.abort(abort.request_id)

    def _apply_abort_flags(self) -> None:
        flags = NamedPipeline(self.redis)
        for rid in self.active:
            flags.named(rid).exists(self.keys.abort_flag(rid))
        for name, flagged in flags.execute().items():
            if flagged:
                self.table.abort(str(name))

    # -- heartbeat ------------------------------------------------------------------------------------

    def heartbeat(self) -> None:
        stats = self.engine.stats()
        bs = stats.block_size
        waiting_blocks = sum(-(-seq.num_tokens // bs) for seq in self.engine.step_scheduler.waiting)
        beat = Heartbeat(
            worker_id=self.worker_id,
            model=self.model_name,
            free_blocks=stats.num_free_blocks,
            total_blocks=stats.num_total_blocks,
            block_size=bs,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            last_step_time=self.last_step_time,
            started_at=self.started_at,
            max_model_len=self.engine.max_model_len,
            waiting_blocks=waiting_blocks,
            num_preemptions=stats.num_preemptions,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            prompt_tokens_total=self.table.prompt_tokens_total,
            generation_tokens_total=self.table.generation_tokens_total,
            prefix_cache_queries_total=stats.prefix_cache_queries,
            prefix_cache_hits_total=stats.prefix_cache_hits,
            iteration_tokens_buckets=stats.iteration_tokens_buckets,
            iteration_tokens_sum=stats.iteration_tokens_sum,
            spec_decode_num_drafts=stats.spec_num_drafts,
            spec_decode_num_draft_tokens=stats.spec_num_draft_tokens,
            spec_decode_num_accepted_tokens=stats.spec_num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=stats.spec_accepted_per_position,
            dtype=str(self.engine.dtype).removeprefix("torch."),
            device=str(self.engine.device),
            draining=self.draining_since is not None,
            beat_at=time.time(),
        )
        key = self.keys.worker(self.worker_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, mapping=beat.to_hash())  # type: ignore[arg-type]
        pipe.expire(key, max(1, int(self.settings.heartbeat_ttl_s + 0.999)))
        # The pool block by block, for the dashboard: beside the heartbeat, of the same moment, gone with it.
        pipe.set(
            self.keys.kv_map(self.worker_id),
            encode_states(self.engine.allocator.block_states()),
            ex=max(1, int(self.settings.heartbeat_ttl_s + 0.999)),
        )
        pipe.sadd(self.keys.workers, self.worker_id)
        # The blocks of what was taken in move from the reservation counter to free/waiting blocks at once,
        # and the taken entries leave the inbox (shared.reservations).
        give_back(pipe, self.keys, self.worker_id, self._taken_blocks)
        if self.inbox_last_id != "0-0":
            pipe.xtrim(
                self.keys.inbox(self.worker_id), minid=next_stream_id(self.inbox_last_id), approximate=False
            )
        pipe.execute()
        self._taken_blocks = 0
        self.last_heartbeat = time.monotonic()
