"""The requests a worker runs: which engine requests carry each, which samples are still going, and the
events and records their progress becomes. Every write goes to the worker's outbox."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from gpu_worker.assignments import engine_requests
from gpu_worker.engine.llm_engine import LLMEngine
from gpu_worker.engine.sequence import Sequence
from gpu_worker.outbox import Outbox
from shared.errors import CodedError, ErrorCode
from shared.keys import Keys
from shared.protocol import GenerateRequest, RequestTimings, TokenEvent, TokenLogprob, WireError
from shared.records import error_events, push_event

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ActiveRequest:
    """A request this worker runs: which engine requests carry it, and which samples are still going."""

    request: GenerateRequest
    engine_ids: list[str]
    pending: set[int]
    # Per sample, the output position of its next token (a resumed sample starts after what it streamed).
    next_position: dict[int, int] = field(default_factory=dict)


class RequestTable:
    """The worker's requests in flight, and what their engine steps publish."""

    def __init__(
        self, engine: LLMEngine, outbox: Outbox, keys: Keys, worker_id: str, request_ttl_s: int
    ) -> None:
        self.engine = engine
        self.outbox = outbox
        self.keys = keys
        self.worker_id = worker_id
        self.request_ttl_s = request_ttl_s
        self.active: dict[str, ActiveRequest] = {}
        # engine request id -> (request id, sample index, or None when the engine's own sample index is it)
        self.engine_ids: dict[str, tuple[str, int | None]] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def drop_all(self, why: str) -> None:
        logger.warning("worker %s: %s; dropping %d requests", self.worker_id, why, len(self.active))
        for active in self.active.values():
            for engine_id in active.engine_ids:
                self.engine.abort_request(engine_id)
                self.engine_ids.pop(engine_id, None)
        self.active.clear()

    def drop(self, rid: str) -> None:
        """Stop running rid without a word: it is no longer this worker's (another will run it)."""
        active = self.active.pop(rid, None)
        if active is None:
            return
        for engine_id in active.engine_ids:
            self.engine.abort_request(engine_id)
            self.engine_ids.pop(engine_id, None)

    def start(self, request: GenerateRequest) -> None:
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
                    self._push_event(active, plan.index, [], [], "length")
                    active.pending.discard(plan.index)
                    continue
                self.engine.add_request(
                    plan.engine_id,
                    plan.prompt_token_ids,
                    plan.params,
                    request.priority,
                    num_resumed_tokens=plan.start,
                )
                active.engine_ids.append(plan.engine_id)
                self.engine_ids[plan.engine_id] = (rid, plan.index)
        except Exception as e:
            for engine_id in active.engine_ids:
                self.engine.abort_request(engine_id)
                self.engine_ids.pop(engine_id, None)
            self.finish_with_error(request, _wire_error(rid, e))
            return
        self.prompt_tokens_total += len(request.prompt_token_ids)
        if active.pending:
            self.active[rid] = active
        else:
            self.outbox.hdel(self.keys.assigned(self.worker_id), rid)

    def abort(self, rid: str) -> None:
        active = self.active.get(rid)
        if active is None:
            return
        for index in sorted(active.pending):
            self._push_event(active, index, [], [], "abort")
        active.pending.clear()
        self._retire(rid)

    def publish(self, seqs: list[Sequence]) -> None:
        done: list[str] = []
        for seq in seqs:
            rid, fixed_index = self.engine_ids[seq.request_id]
            index = seq.index if fixed_index is None else fixed_index
            active = self.active[rid]
            if index not in active.pending:
                continue  # a beam search resumed after a failover: this sample was delivered before
            # A sample sends the tokens of its last step (more than one when drafts were accepted); a beam
            # search's outputs arrive whole when it ends.
            count = seq.num_output_tokens if seq.params.use_beam_search else seq.num_step_tokens
            tokens = seq.token_ids[-count:]
            logprobs = []
            if seq.params.logprobs is not None:
                logprobs = [
                    TokenLogprob(token_id=token, logprob=lp, top=top)
                    for token, lp, top in zip(tokens, seq.logprobs[-count:], seq.top_logprobs[-count:])
                ]
            first = active.next_position.get(index, 0) == 0
            self._push_event(
                active,
                index,
                tokens,
                logprobs,
                seq.finish_reason,
                num_cached_tokens=seq.num_cached_tokens if first else None,
                prompt_logprobs=_prompt_logprobs(seq) if first else None,
                timings=_timings(seq) if seq.is_finished else None,
            )
            self.generation_tokens_total += len(tokens)
            if seq.is_finished:
                active.pending.discard(index)
                if not active.pending:
                    done.append(rid)
        for rid in done:
            self._retire(rid)

    def _push_event(
        self,
        active: ActiveRequest,
        index: int,
        token_ids: list[int],
        logprobs: list[TokenLogprob],
        finish_reason: str | None,
        error: WireError | None = None,
        *,
        num_cached_tokens: int | None = None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
        timings: RequestTimings | None = None,
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
            num_cached_tokens=num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            timings=timings,
        )
        push_event(self.outbox, self.keys, event, self.request_ttl_s)

    def _retire(self, rid: str) -> None:
        """Every sample of rid is done: forget it here and in the assigned hash."""
        active = self.active.pop(rid)
        for engine_id in active.engine_ids:
            self.engine.abort_request(engine_id)  # releases finished ones, stops any still running
            self.engine_ids.pop(engine_id, None)
        self.outbox.hdel(self.keys.assigned(self.worker_id), rid)

    def finish_with_error(self, request: GenerateRequest, error: WireError) -> None:
        for event in error_events(request, error, self.worker_id):
            push_event(self.outbox, self.keys, event, self.request_ttl_s)
        self.outbox.hdel(self.keys.assigned(self.worker_id), request.request_id)

    def fail_all(self, error: WireError) -> None:
        for rid in list(self.active):
            active = self.active[rid]
            for index in sorted(active.pending):
                self._push_event(active, index, [], [], "error", error)
            active.pending.clear()
            self._retire(rid)


def _prompt_logprobs(seq: Sequence) -> list[TokenLogprob | None] | None:
    """One entry per prompt token, None for the first (it has no context); None when not asked for."""
    if seq.params.prompt_logprobs is None:
        return None
    prompt = seq.token_ids[: seq.num_prompt_tokens]
    entries: list[TokenLogprob | None] = [None]
    for token, logprob, top in zip(prompt[1:], seq.prompt_logprobs, seq.prompt_top_logprobs):
        entries.append(TokenLogprob(token_id=token, logprob=logprob, top=top))
    return entries


def _timings(seq: Sequence) -> RequestTimings | None:
    """Where a finished sample's time went; None for one that never sampled here."""
    if seq.first_scheduled_time is None or seq.first_token_time is None or seq.last_token_time is None:
        return None
    return RequestTimings(
        queued_s=seq.first_scheduled_time - seq.arrival_time,
        prefill_s=seq.first_token_time - seq.first_scheduled_time,
        decode_s=seq.last_token_time - seq.first_token_time,
    )


def _wire_error(request_id: str, error: Exception) -> WireError:
    """What the client is told about a request the engine could not take."""
    if isinstance(error, CodedError):
        return WireError.of(error)
    logger.exception("request %s could not be started", request_id, exc_info=error)
    return WireError(code=ErrorCode.ENGINE_ERROR, message=f"the worker could not start the request: {error}")
