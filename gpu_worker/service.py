"""The worker service: an engine fed from this worker's Redis inbox, publishing tokens after every step."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pydantic
import redis

from gpu_worker.assignments import engine_requests, read_assignment, salvage_request
from gpu_worker.engine import LLMEngine
from gpu_worker.outbox import Outbox
from gpu_worker.sequence import Sequence
from gpu_worker.settings import WorkerSettings, engine_config
from shared.backoff import Backoff
from shared.errors import CodedError, ErrorCode
from shared.keys import WORKER_GROUP
from shared.protocol import (
    AbortMessage,
    Assignment,
    GenerateRequest,
    Heartbeat,
    TokenEvent,
    TokenLogprob,
    WireError,
    decode,
)
from shared.records import error_events, push_event
from shared.redis_client import NamedPipeline, connect

logger = logging.getLogger(__name__)

INBOX_READ_COUNT = 64  # inbox entries taken per read
IDLE_BLOCK_MS = 100  # how long an idle worker waits on its inbox before looking at aborts and heartbeats
# A step running longer than this is taken as hung: the heartbeat is no longer kept alive, the worker is
# declared dead and its requests move on. Far above any real step (a 2048-token CPU prefill takes seconds).
MAX_STEP_S = 300.0


@dataclass(slots=True)
class ActiveRequest:
    """A request this worker runs: which engine requests carry it, and which samples are still going."""

    request: GenerateRequest
    engine_ids: list[str]
    pending: set[int]
    # Per sample, the output position of its next token (a resumed sample starts after what it streamed).
    next_position: dict[int, int] = field(default_factory=dict)


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
        self.model_name = settings.model or "SmolLM2-135M-Instruct"
        self.active: dict[str, ActiveRequest] = {}
        # engine request id -> (request id, sample index, or None when the engine's own sample index is it)
        self.engine_ids: dict[str, tuple[str, int | None]] = {}
        self.inbox_last_id = "0-0"
        self.started_at = time.time()
        self.last_step_time = 0.0
        self.last_heartbeat = 0.0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.stopping = False
        self.step_started: float | None = None  # monotonic start of the step in progress
        self._keep_alive_stop = threading.Event()
        self._stopped = threading.Event()  # set by SIGTERM/SIGINT: cuts a backoff wait short
        self.aborts = self.redis.pubsub(ignore_subscribe_messages=True)
        self.outbox = Outbox()
        self.registered = False
        self._taken_blocks = 0  # reserved for assignments taken in since the last heartbeat
        self._backoff = Backoff()

    # -- lifecycle ----------------------------------------------------------------------------------

    def register(self) -> None:
        """Join (or rejoin, after Redis was away): inbox group, abort channel, heartbeat.

        An inbox that is gone while requests run here means the scheduler declared this worker dead and
        re-queued them, or Redis came back empty: either way they are no longer this worker's to finish.
        """
        if not self.redis.exists(self.keys.inbox(self.worker_id)):
            self._taken_blocks = 0  # its reservation counter went with it
            if self.active:
                self._drop_all("its inbox is gone (declared dead, or Redis lost its data)")
        self._create_group()
        self.aborts.close()
        self.aborts = self.redis.pubsub(ignore_subscribe_messages=True)
        self.aborts.subscribe(self.keys.aborts)
        self._apply_abort_flags()  # aborts published while Redis was away were missed
        self.heartbeat()
        self.registered = True
        logger.info("worker %s ready: %d KV blocks", self.worker_id, self.engine.allocator.num_blocks)

    def _create_group(self) -> None:
        try:
            self.redis.xgroup_create(self.keys.inbox(self.worker_id), WORKER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def keep_alive(self) -> None:
        """Extend the heartbeat's TTL every interval, also while a step outlasts it (a long CPU prefill).

        Runs on its own thread; the full heartbeat still comes from the loop between steps. EXPIRE never
        recreates a heartbeat the scheduler has removed, and a step past MAX_STEP_S is left to expire.
        """
        key = self.keys.worker(self.worker_id)
        ttl = max(1, int(self.settings.heartbeat_ttl_s + 0.999))
        while not self._keep_alive_stop.wait(self.settings.heartbeat_interval_s):
            started = self.step_started
            if started is not None and time.monotonic() - started > MAX_STEP_S:
                continue
            try:
                self.redis.expire(key, ttl)
            except redis.RedisError as e:  # the loop's own heartbeat reports a Redis that stays away
                logger.debug("keep-alive failed: %s", e)

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT; then drop the heartbeat so the scheduler re-queues our requests.

        Redis going away never ends the process: the loop waits (with backoff) and registers again.
        """
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        keeper = threading.Thread(target=self.keep_alive, name="keep-alive", daemon=True)
        keeper.start()
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
            with contextlib.suppress(redis.RedisError):
                self.redis.delete(self.keys.worker(self.worker_id))
            self.aborts.close()

    def _wait_for_redis(self, error: redis.RedisError) -> None:
        if self._backoff.failures == 0:
            logger.warning(
                "Redis unavailable (%s); holding %d unsent writes, reconnecting", error, len(self.outbox)
            )
        self.registered = False
        self._stopped.wait(self._backoff.next_delay())

    def _stop(self, signum: int, frame: Any) -> None:
        self.stopping = True
        self._stopped.set()

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
                self._fail_all(
                    WireError(
                        code=ErrorCode.ENGINE_ERROR, message="the engine failed while running this request"
                    )
                )
            else:
                self.last_step_time = time.time()
                self._publish(seqs)
            finally:
                self.step_started = None
        self.outbox.flush(self.redis)
        if taken or time.monotonic() - self.last_heartbeat >= self.settings.heartbeat_interval_s:
            self.heartbeat()

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
        for _, messages in reply or []:
            for entry_id, fields in messages:
                entries.append((entry_id, (fields or {}).get("data")))
                # Reserved for it by the scheduler: handed back by the heartbeat that counts it (heartbeat()).
                self._taken_blocks += _int_or_zero((fields or {}).get("blocks"))
        if not entries:
            return 0
        pipe = self.outbox
        assignments: dict[str, Assignment] = {}
        for entry_id, data in entries:
            try:
                assignments[entry_id] = read_assignment(data)
            except CodedError as e:
                self._refuse_unreadable(entry_id, data, e, pipe)
        flags = NamedPipeline(self.redis)
        for entry_id, a in assignments.items():
            flags.named(entry_id).exists(self.keys.abort_flag(a.request.request_id))
        aborted = flags.execute()
        for entry_id, assignment in assignments.items():
            if aborted[entry_id]:
                pipe.hdel(self.keys.assigned(self.worker_id), assignment.request.request_id)
            else:
                self._start(assignment.request, pipe)
        # Handed on to the engine: from here a failure is recovered through the assigned hash, not the inbox
        # (whose taken entries the next heartbeat trims).
        pipe.xack(inbox, WORKER_GROUP, *[entry_id for entry_id, _ in entries])
        self.inbox_last_id = entries[-1][0]
        self.outbox.flush(self.redis)
        return len(entries)

    def _refuse_unreadable(self, entry_id: str, data: str | None, error: CodedError, pipe: Any) -> None:
        request = salvage_request(data)
        logger.error(
            "inbox entry %s (request %s): %s", entry_id, request.request_id if request else "unknown", error
        )
        if request is not None and request.request_id not in self.active:
            self._finish_with_error(request, WireError.of(error), pipe)

    def _rejoin(self) -> None:
        """The scheduler took this worker for dead and re-queued its requests: drop them, register again."""
        self._drop_all("it was declared dead (its heartbeat lapsed)")
        self._taken_blocks = 0
        self._create_group()
        self.heartbeat()

    def _drop_all(self, why: str) -> None:
        logger.warning("worker %s: %s; dropping %d requests", self.worker_id, why, len(self.active))
        for active in self.active.values():
            for engine_id in active.engine_ids:
                self.engine.abort_request(engine_id)
                self.engine_ids.pop(engine_id, None)
        self.active.clear()
        self.outbox.clear()

    def _start(self, request: GenerateRequest, pipe: Any) -> None:
        """Add the request to the engine; any failure answers it with an error and leaves nothing behind."""
        rid = request.request_id
        if rid in self.active:
            logger.warning("request %s is already running here; ignoring its second assignment", rid)
            return
        active = ActiveRequest(request, [], set(request.sample_indices()))
        try:
            for plan in engine_requests(request):
                if plan.index is not None:
                    active.next_position[plan.index] = plan.start
                if plan.params is None:  # it streamed all its tokens before its worker died
                    assert plan.index is not None
                    self._push_event(pipe, active, plan.index, [], [], "length")
                    active.pending.discard(plan.index)
                    continue
                self.engine.add_request(plan.engine_id, plan.prompt_token_ids, plan.params, request.priority)
                active.engine_ids.append(plan.engine_id)
                self.engine_ids[plan.engine_id] = (rid, plan.index)
        except Exception as e:
            for engine_id in active.engine_ids:
                self.engine.abort_request(engine_id)
                self.engine_ids.pop(engine_id, None)
            self._finish_with_error(request, _wire_error(rid, e), pipe)
            return
        self.prompt_tokens_total += len(request.prompt_token_ids)
        if active.pending:
            self.active[rid] = active
        else:
            pipe.hdel(self.keys.assigned(self.worker_id), rid)

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
            self._abort(abort.request_id)

    def _apply_abort_flags(self) -> None:
        flags = NamedPipeline(self.redis)
        for rid in self.active:
            flags.named(rid).exists(self.keys.abort_flag(rid))
        for name, flagged in flags.execute().items():
            if flagged:
                self._abort(str(name))

    def _abort(self, rid: str) -> None:
        active = self.active.get(rid)
        if active is None:
            return
        for index in sorted(active.pending):
            self._push_event(self.outbox, active, index, [], [], "abort")
        active.pending.clear()
        self._retire(rid, self.outbox)

    # -- publishing -----------------------------------------------------------------------------------

    def _publish(self, seqs: list[Sequence]) -> None:
        pipe = self.outbox
        done: list[str] = []
        for seq in seqs:
            rid, fixed_index = self.engine_ids[seq.request_id]
            index = seq.index if fixed_index is None else fixed_index
            active = self.active[rid]
            token = seq.token_ids[-1]
            logprobs = []
            if seq.params.logprobs is not None:
                logprobs = [TokenLogprob(token_id=token, logprob=seq.logprobs[-1], top=seq.top_logprobs[-1])]
            self._push_event(pipe, active, index, [token], logprobs, seq.finish_reason)
            self.generation_tokens_total += 1
            if seq.is_finished:
                active.pending.discard(index)
                if not active.pending:
                    done.append(rid)
        for rid in done:
            self._retire(rid, pipe)

    def _push_event(
        self,
        pipe: Any,
        active: ActiveRequest,
        index: int,
        token_ids: list[int],
        logprobs: list[TokenLogprob],
        finish_reason: str | None,
        error: WireError | None = None,
    ) -> None:
        request = active.request
        start = active.next_position.get(index, 0)
        active.next_position[index] = start + len(token_ids)
        event = TokenEvent(
            request_id=request.request_id,
            index=index,
            start=start,
            token_ids=token_ids,
            logprobs=logprobs or None,
            finish_reason=finish_reason,  # type: ignore[arg-type]  # the engine's reasons are FinishReasons
            num_prompt_tokens=len(request.prompt_token_ids),
            worker_id=self.worker_id,
            error=error,
        )
        push_event(pipe, self.keys, event, self.settings.request_ttl_s)

    def _retire(self, rid: str, pipe: Any) -> None:
        """Every sample of rid is done: forget it here and in the assigned hash."""
        active = self.active.pop(rid)
        for engine_id in active.engine_ids:
            self.engine.abort_request(engine_id)  # releases finished ones, stops any still running
            self.engine_ids.pop(engine_id, None)
        pipe.hdel(self.keys.assigned(self.worker_id), rid)

    def _finish_with_error(self, request: GenerateRequest, error: WireError, pipe: Any) -> None:
        for event in error_events(request, error, self.worker_id):
            push_event(pipe, self.keys, event, self.settings.request_ttl_s)
        pipe.hdel(self.keys.assigned(self.worker_id), request.request_id)

    def _fail_all(self, error: WireError) -> None:
        pipe = self.outbox
        for rid in list(self.active):
            active = self.active[rid]
            for index in sorted(active.pending):
                self._push_event(pipe, active, index, [], [], "error", error)
            active.pending.clear()
            self._retire(rid, pipe)

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
            inbox_last_id=self.inbox_last_id,
            num_preemptions=stats.num_preemptions,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
        )
        key = self.keys.worker(self.worker_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, mapping=beat.to_hash())  # type: ignore[arg-type]
        pipe.expire(key, max(1, int(self.settings.heartbeat_ttl_s + 0.999)))
        pipe.sadd(self.keys.workers, self.worker_id)
        # The blocks of what was taken in move from the reservation counter to free/waiting blocks at once,
        # and the taken entries leave the inbox.
        if self._taken_blocks:
            pipe.decrby(self.keys.reserved(self.worker_id), self._taken_blocks)
        if self.inbox_last_id != "0-0":
            pipe.xtrim(
                self.keys.inbox(self.worker_id), minid=_next_stream_id(self.inbox_last_id), approximate=False
            )
        pipe.execute()
        self._taken_blocks = 0
        self.last_heartbeat = time.monotonic()


def _wire_error(request_id: str, error: Exception) -> WireError:
    """What the client is told about a request the engine could not take."""
    if isinstance(error, CodedError):
        return WireError.of(error)
    logger.exception("request %s could not be started", request_id, exc_info=error)
    return WireError(code=ErrorCode.ENGINE_ERROR, message=f"the worker could not start the request: {error}")


def _int_or_zero(value: str | None) -> int:
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0


def _next_stream_id(entry_id: str) -> str:
    """The smallest stream id after entry_id ("ms-seq")."""
    ms, _, seq = entry_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"
