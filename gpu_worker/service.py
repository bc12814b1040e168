"""The worker service: an engine fed from this worker's Redis inbox, publishing tokens after every step."""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from gpu_worker.config import EngineConfig
from gpu_worker.engine import LLMEngine
from gpu_worker.sampling_params import SamplingParams
from gpu_worker.sequence import Sequence
from shared.keys import WORKER_GROUP
from shared.protocol import (
    AbortMessage,
    Assignment,
    GenerateRequest,
    Heartbeat,
    TokenEvent,
    TokenLogprob,
    decode,
    encode,
)
from shared.settings import WorkerSettings

logger = logging.getLogger(__name__)

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
        self.redis = redis.Redis.from_url(settings.redis_url)
        self.engine = engine or LLMEngine(
            settings.model,
            EngineConfig(
                block_size=settings.block_size,
                num_kv_blocks=settings.num_kv_blocks,
                kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
                gpu_memory_utilization=settings.gpu_memory_utilization,
                max_num_seqs=settings.max_num_seqs,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                enable_prefix_caching=settings.enable_prefix_caching,
            ),
            dtype=settings.dtype,
            device=settings.device,
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
        self.aborts = self.redis.pubsub(ignore_subscribe_messages=True)

    # -- lifecycle ----------------------------------------------------------------------------------

    def register(self) -> None:
        self._create_group()
        self.aborts.subscribe(self.keys.aborts)
        self.heartbeat()
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
        """Serve until SIGTERM/SIGINT; then drop the heartbeat so the scheduler re-queues our requests."""
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        self.register()
        keeper = threading.Thread(target=self.keep_alive, name="keep-alive", daemon=True)
        keeper.start()
        try:
            while not self.stopping:
                self.run_once()
        finally:
            self._keep_alive_stop.set()
            keeper.join()
            self.redis.delete(self.keys.worker(self.worker_id))
            self.aborts.close()

    def _stop(self, signum: int, frame: Any) -> None:
        self.stopping = True

    def run_once(self) -> None:
        """Take new work and aborts, run one engine step, publish its tokens; heartbeat when due."""
        busy = self.engine.has_unfinished_requests()
        taken = self._read_inbox(block_ms=None if busy else IDLE_BLOCK_MS)
        self._apply_aborts()
        if self.engine.has_unfinished_requests():
            self.step_started = time.monotonic()
            try:
                seqs = self.engine.step()
            except Exception:
                logger.exception("engine step failed; failing every active request")
                self._fail_all("the engine failed while running this request")
            else:
                self.last_step_time = time.time()
                self._publish(seqs)
            finally:
                self.step_started = None
        if taken or time.monotonic() - self.last_heartbeat >= self.settings.heartbeat_interval_s:
            self.heartbeat()

    # -- inbox and aborts ---------------------------------------------------------------------------

    def _read_inbox(self, block_ms: int | None) -> int:
        inbox = self.keys.inbox(self.worker_id)
        try:
            reply: Any = self.redis.xreadgroup(
                WORKER_GROUP, self.worker_id, {inbox: ">"}, count=64, block=block_ms
            )
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._rejoin()
            return 0
        entries = [(eid.decode(), fields[b"data"]) for _, messages in reply or [] for eid, fields in messages]
        if not entries:
            return 0
        assignments = [decode(Assignment, data) for _, data in entries]
        pipe = self.redis.pipeline(transaction=False)
        for a in assignments:
            pipe.exists(self.keys.abort_flag(a.request.request_id))
        aborted = pipe.execute()
        pipe = self.redis.pipeline(transaction=False)
        for assignment, was_aborted in zip(assignments, aborted):
            if was_aborted:
                pipe.hdel(self.keys.assigned(self.worker_id), assignment.request.request_id)
            else:
                self._start(assignment.request, pipe)
        # Handed on to the engine: from here a failure is recovered through the assigned hash, not the inbox.
        pipe.xack(inbox, WORKER_GROUP, *[eid for eid, _ in entries])
        pipe.execute()
        self.inbox_last_id = entries[-1][0]
        return len(entries)

    def _rejoin(self) -> None:
        """The scheduler took this worker for dead and re-queued its requests: drop them, register again."""
        logger.warning(
            "worker %s was declared dead (its heartbeat lapsed); dropping %d re-queued requests, rejoining",
            self.worker_id,
            len(self.active),
        )
        for active in self.active.values():
            for engine_id in active.engine_ids:
                self.engine.abort_request(engine_id)
                self.engine_ids.pop(engine_id, None)
        self.active.clear()
        self._create_group()
        self.heartbeat()

    def _start(self, request: GenerateRequest, pipe: Any) -> None:
        rid = request.request_id
        spec = request.sampling
        active = ActiveRequest(request, [], set(request.sample_indices()))
        try:
            if request.samples is None and not request.resume:
                params = SamplingParams(**spec.model_dump())
                self.engine.add_request(rid, request.prompt_token_ids, params, request.priority)
                active.engine_ids.append(rid)
                self.engine_ids[rid] = (rid, None)
            else:
                for i in sorted(active.pending):
                    self._start_resumed(request, i, active)
        except ValueError as e:
            for engine_id in active.engine_ids:
                self.engine.abort_request(engine_id)
                self.engine_ids.pop(engine_id, None)
            self._finish_with_error(request, str(e), pipe)
            return
        self.prompt_tokens_total += len(request.prompt_token_ids)
        self.active[rid] = active

    def _start_resumed(self, request: GenerateRequest, index: int, active: ActiveRequest) -> None:
        """One sample continues from the tokens it streamed on a worker that died: recompute, then go on."""
        spec = request.sampling
        done = list(request.resume.get(index, []))
        values = spec.model_dump()
        values.update(
            n=1,
            seed=None if spec.seed is None else spec.seed + index,
            max_tokens=None if spec.max_tokens is None else spec.max_tokens - len(done),
            min_tokens=max(0, spec.min_tokens - len(done)),
        )
        if values["max_tokens"] is not None and values["max_tokens"] < 1:
            raise ValueError(f"sample {index} already has its {spec.max_tokens} tokens")
        engine_id = f"{request.request_id}#{index}"
        self.engine.add_request(
            engine_id, request.prompt_token_ids + done, SamplingParams(**values), request.priority
        )
        active.engine_ids.append(engine_id)
        active.next_position[index] = len(done)
        self.engine_ids[engine_id] = (request.request_id, index)

    def _apply_aborts(self) -> None:
        while True:
            message = self.aborts.get_message(timeout=0)
            if message is None:
                return
            if message.get("type") != "message":
                continue
            abort = decode(AbortMessage, message["data"])
            active = self.active.get(abort.request_id)
            if active is None:
                continue
            pipe = self.redis.pipeline(transaction=False)
            for index in sorted(active.pending):
                self._push_event(pipe, active, index, [], [], "abort")
            active.pending.clear()
            self._retire(abort.request_id, pipe)
            pipe.execute()

    # -- publishing -----------------------------------------------------------------------------------

    def _publish(self, seqs: list[Sequence]) -> None:
        if not seqs:
            return
        pipe = self.redis.pipeline(transaction=False)
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
        pipe.execute()

    def _push_event(
        self,
        pipe: Any,
        active: ActiveRequest,
        index: int,
        token_ids: list[int],
        logprobs: list[TokenLogprob],
        finish_reason: str | None,
    ) -> None:
        request = active.request
        rid = request.request_id
        start = active.next_position.get(index, 0)
        active.next_position[index] = start + len(token_ids)
        event = TokenEvent(
            request_id=rid,
            index=index,
            start=start,
            token_ids=token_ids,
            logprobs=logprobs or None,
            finish_reason=finish_reason,  # type: ignore[arg-type]
            num_prompt_tokens=len(request.prompt_token_ids),
            worker_id=self.worker_id,
        )
        ttl = self.settings.request_ttl_s
        if token_ids:
            pipe.rpush(self.keys.tokens(rid, index), *token_ids)
            pipe.expire(self.keys.tokens(rid, index), ttl)
        if finish_reason is not None:
            pipe.hset(self.keys.finished(rid), str(index), finish_reason)
            pipe.expire(self.keys.finished(rid), ttl)
        pipe.publish(self.keys.events(rid), encode(event))

    def _retire(self, rid: str, pipe: Any) -> None:
        """Every sample of rid is done: forget it here and in the assigned hash."""
        active = self.active.pop(rid)
        for engine_id in active.engine_ids:
            self.engine.abort_request(engine_id)  # releases finished ones, stops any still running
            self.engine_ids.pop(engine_id, None)
        pipe.hdel(self.keys.assigned(self.worker_id), rid)

    def _finish_with_error(self, request: GenerateRequest, message: str, pipe: Any) -> None:
        for index in request.sample_indices():
            event = TokenEvent(
                request_id=request.request_id,
                index=index,
                start=len(request.resume.get(index, [])),
                token_ids=[],
                finish_reason="error",
                num_prompt_tokens=len(request.prompt_token_ids),
                worker_id=self.worker_id,
                error=message,
            )
            pipe.publish(self.keys.events(request.request_id), encode(event))
        pipe.hdel(self.keys.assigned(self.worker_id), request.request_id)

    def _fail_all(self, message: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for rid in list(self.active):
            active = self.active[rid]
            self._finish_with_error(active.request, message, pipe)
            active.pending.clear()
            self._retire(rid, pipe)
        pipe.execute()

    # -- heartbeat ------------------------------------------------------------------------------------

    def heartbeat(self) -> None:
        stats = self.engine.stats()
        bs = stats.block_size
        waiting_blocks = sum(-(-seq.num_tokens // bs) for seq in self.engine.scheduler.waiting)
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
        pipe.execute()
        self.last_heartbeat = time.monotonic()
