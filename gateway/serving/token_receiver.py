"""A request's token events as the gateway receives them: in order per sample, duplicates dropped, gaps filled
from the token record."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pydantic
import redis

from gateway.serving.event_hub import EventHub
from shared.errors import CodedError, ErrorCode
from shared.keys import Keys
from shared.protocol import RequestTimings, SampleEnd, TokenEvent, TokenLogprob, WireError, decode
from shared.records import parse_ends, parse_tokens
from shared.redis_client import NamedPipeline

logger = logging.getLogger(__name__)

SUBSCRIBE_TIMEOUT_S = 5.0
MAX_EVENTS_PER_POLL = 256
RECONNECT_INTERVAL_S = 0.5  # how often a request looks whether Redis is back


class GenerationError(CodedError):
    """A worker or the scheduler failed the request (code and text are theirs), or its tokens were lost."""

    @classmethod
    def of(cls, error: WireError) -> GenerationError:
        return cls(error.code, error.message)


@dataclass(slots=True)
class SampleTokens:
    """New tokens of one sample, in order, right after the ones delivered before."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # per token; None where the worker sent none (or a gap was filled)
    finish_reason: str | None = None
    arrived_at: float = field(default_factory=time.monotonic)
    timings: RequestTimings | None = None  # with the end: where the sample's time went on its worker
    # With the sample's first event only (None when it came from the record: a gap, a resumed stream).
    num_cached_tokens: int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class TokenReceiver:
    """Subscribes to a request's channel (before the request is queued) and hands its tokens over in order.

    Every event names the position of its first token, so per sample the next expected position is
    kept: the part of an event before it is a duplicate (a resumed sample re-sending), and an event
    starting after it means events were missed, whose tokens are read from the sample's record.

    Messages come through the process's event hub. When its connection to Redis drops, the hub connects
    again, and the receiver reads what it missed from the record; a Redis that stays away past
    outage_grace_s fails it with queue_unavailable. One that comes back without the request (a failover
    whose new master never got it, or lost data) gets it again from resend(), or fails it without one.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        request_id: str,
        num_samples: int,
        *,
        hub: EventHub,
        outage_grace_s: float = 30.0,
        wakeup: threading.Event | None = None,
        resend: Callable[[], None] | None = None,
    ) -> None:
        self._client = client
        self._keys = keys
        self.request_id = request_id
        self.expected = [0] * num_samples
        self.finished: dict[int, str] = {}
        self._outage_grace_s = outage_grace_s
        self._resend = resend
        self._hub = hub
        # In place before the request is queued: confirmed on return, or (with a shared wake-up) by confirm().
        self._subscription = hub.subscribe(
            keys.events(request_id), SUBSCRIBE_TIMEOUT_S, wakeup, wait=wakeup is None
        )
        self._epoch = hub.epoch

    def confirm(self) -> None:
        """Wait for the subscription to be in place (at once when it was confirmed on creation)."""
        self._hub.confirm(self._subscription, SUBSCRIBE_TIMEOUT_S)
        self._epoch = self._hub.epoch

    @property
    def pending(self) -> bool:
        """Messages are waiting to be polled."""
        return not self._subscription.messages.empty()

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.expected)

    @property
    def connected(self) -> bool:
        """The hub's connection is up, and nothing was missed while it was down."""
        return self._hub.down_since is None and self._hub.epoch == self._epoch

    @property
    def back_for(self) -> float:
        """Seconds since the hub's connection came back after its last loss (infinite: never lost)."""
        back = self._hub.back_at
        return math.inf if back is None else time.monotonic() - back

    def poll(self, timeout: float) -> list[SampleTokens]:
        """What arrives within timeout (all that is waiting, once the first event is in); when nothing does,
        the ends recorded without their events."""
        if not self.connected:
            return self._after_outage(timeout)
        out = self._receive(timeout)
        if out:
            return out
        try:
            return self.recover()
        except (redis.ConnectionError, redis.TimeoutError):
            return []  # the hub notices a Redis that is away; the next poll waits for it

    def _receive(self, timeout: float) -> list[SampleTokens]:
        messages = self._subscription.messages
        out: list[SampleTokens] = []
        try:
            data = messages.get(timeout=max(timeout, 0.0))
            for _ in range(MAX_EVENTS_PER_POLL):
                event = self._parse(data)
                if event is not None:
                    out.extend(self.accept(event))
                data = messages.get_nowait()
        except queue.Empty:
            pass
        return out

    def _after_outage(self, timeout: float) -> list[SampleTokens]:
        """While the hub is disconnected, wait (failing once the outage outlasts its grace); once it is back,
        catch up from the record, if Redis still has the request."""
        down_since = self._hub.down_since
        if down_since is not None:
            down = time.monotonic() - down_since
            if down > self._outage_grace_s:
                raise GenerationError(
                    ErrorCode.QUEUE_UNAVAILABLE, f"Redis has been unreachable for {down:.0f} s"
                )
            time.sleep(max(0.0, min(timeout, RECONNECT_INTERVAL_S)))
            return []
        try:
            known = self._client.exists(self._keys.request_meta(self.request_id))
        except redis.RedisError:
            return []
        if not known:
            if self._resend is None:
                raise GenerationError(
                    ErrorCode.QUEUE_UNAVAILABLE,
                    "Redis came back without this request (it lost its data); send it again",
                )
            # A failover to a replica that never got it, or a Redis that lost its data: queued again, to go
            # on from where each sample's stream is.
            logger.warning("request %s: Redis came back without it; sending it again", self.request_id)
            try:
                self._resend()
            except redis.RedisError:
                return []
        self._epoch = self._hub.epoch
        logger.info("request %s: Redis is back; catching up from the record", self.request_id)
        return self.catch_up()

    def catch_up(self) -> list[SampleTokens]:
        """Every sample's recorded tokens past the expected position, and the recorded ends."""
        out = []
        for index, expected in enumerate(self.expected):
            if index not in self.finished and (missed := self._record(index, expected, -1)):
                out.append(self._deliver(index, missed, [None] * len(missed), None))
        return out + self.recover()

    def record(self) -> tuple[list[list[int]], dict[int, SampleEnd]]:
        """The request's whole record: each sample's tokens so far, and how those that ended ended."""
        pipe = NamedPipeline(self._client)
        for index in range(len(self.expected)):
            pipe.named(index).lrange(self._keys.tokens(self.request_id, index), 0, -1)
        pipe.named("ends").hgetall(self._keys.finished(self.request_id))
        replies = pipe.execute()
        tokens = [parse_tokens(replies[index]) for index in range(len(self.expected))]
        return tokens, parse_ends(replies["ends"])

    def skip(self, index: int, count: int, finish_reason: str | None = None) -> None:
        """The first count tokens of a sample (and its end, if given) were handled without this receiver."""
        self.expected[index] = count
        if finish_reason is not None:
            self.finished[index] = finish_reason

    def recover(self) -> list[SampleTokens]:
        """Samples whose end was recorded but whose last events never came (their worker died after
        recording them): the rest of their tokens, read from the record."""
        fields: dict[str, str] = self._client.hgetall(self._keys.finished(self.request_id))  # type: ignore[assignment]
        out = []
        for index, end in sorted(parse_ends(fields).items()):
            if not 0 <= index < len(self.expected) or index in self.finished:
                continue
            if end.error is not None:
                raise GenerationError.of(end.error)
            tokens = self._record(index, self.expected[index], -1)
            out.append(self._deliver(index, tokens, [None] * len(tokens), end.finish_reason))
        return out

    def accept(self, event: TokenEvent) -> list[SampleTokens]:
        """The new part of an event; raises GenerationError for an event carrying an error."""
        if event.error is not None:
            raise GenerationError.of(event.error)
        if event.finish_reason == "error":
            raise GenerationError(ErrorCode.INTERNAL_ERROR, "the request failed")
        index = event.index
        if not 0 <= index < len(self.expected) or index in self.finished:
            return []
        token_ids = list(event.token_ids)
        logprobs: list[TokenLogprob | None] = [None] * len(token_ids)
        if event.logprobs is not None:
            logprobs = list(event.logprobs)
        expected = self.expected[index]
        if event.start < expected:
            skip = expected - event.start
            token_ids, logprobs = token_ids[skip:], logprobs[skip:]
            if not token_ids and event.finish_reason is None:
                return []
        elif event.start > expected:
            missed = self._record(index, expected, event.start - 1)
            if len(missed) != event.start - expected:
                raise GenerationError(
                    ErrorCode.TOKENS_LOST, f"tokens {expected}..{event.start - 1} of sample {index} were lost"
                )
            unknown: list[TokenLogprob | None] = [None] * len(missed)
            token_ids, logprobs = missed + token_ids, unknown + logprobs
        delivered = self._deliver(index, token_ids, logprobs, event.finish_reason)
        delivered.timings = event.timings
        if event.start == expected == 0:
            delivered.num_cached_tokens = event.num_cached_tokens
            delivered.prompt_logprobs = event.prompt_logprobs
        return [delivered]

    def _deliver(
        self, index: int, token_ids: list[int], logprobs: list[TokenLogprob | None], reason: str | None
    ) -> SampleTokens:
        self.expected[index] += len(token_ids)
        if reason is not None:
            self.finished[index] = reason
        return SampleTokens(index, token_ids, logprobs, reason)

    def _record(self, index: int, first: int, last: int) -> list[int]:
        values = self._client.lrange(self._keys.tokens(self.request_id, index), first, last)
        return parse_tokens(values)  # type: ignore[arg-type]

    def _parse(self, data: str | bytes) -> TokenEvent | None:
        try:
            event = decode(TokenEvent, data)
        except pydantic.ValidationError:
            logger.warning("request %s: dropped a malformed event", self.request_id)
            return None
        return event if event.request_id == self.request_id else None

    def close(self) -> None:
        self._hub.unsubscribe(self._subscription)
