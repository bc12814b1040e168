"""A request's token events as the gateway receives them: in order per sample, duplicates dropped, gaps filled
from the token record."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import pydantic
import redis

from shared.errors import CodedError, ErrorCode
from shared.keys import Keys
from shared.protocol import SampleEnd, TokenEvent, TokenLogprob, WireError, decode
from shared.records import parse_ends, parse_tokens
from shared.redis_client import NamedPipeline

logger = logging.getLogger(__name__)

SUBSCRIBE_TIMEOUT_S = 5.0
MAX_EVENTS_PER_POLL = 256
RECONNECT_INTERVAL_S = 0.5  # between attempts to subscribe again while Redis is away


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


class TokenReceiver:
    """Subscribes to a request's channel (before the request is queued) and hands its tokens over in order.

    Every event names the position of its first token, so per sample the next expected position is
    kept: the part of an event before it is a duplicate (a resumed sample re-sending), and an event
    starting after it means events were missed, whose tokens are read from the sample's record.

    When the connection to Redis drops, it subscribes again (each poll tries once) and reads what it missed
    from the record; a Redis that stays away past outage_grace_s, or comes back without the request, fails it
    with queue_unavailable.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        request_id: str,
        num_samples: int,
        *,
        outage_grace_s: float = 30.0,
    ) -> None:
        self._client = client
        self._keys = keys
        self.request_id = request_id
        self.expected = [0] * num_samples
        self.finished: dict[int, str] = {}
        self._outage_grace_s = outage_grace_s
        self._lost_at: float | None = None  # when the connection dropped, while it is down
        self._pubsub: Any = client.pubsub()
        try:
            self._subscribe()
        except BaseException:
            self.close()
            raise

    def _subscribe(self) -> None:
        # Wait for the confirmation: only then is the subscription in place before the request is queued.
        self._pubsub.subscribe(self._keys.events(self.request_id))
        deadline = time.monotonic() + SUBSCRIBE_TIMEOUT_S
        while time.monotonic() < deadline:
            message = self._pubsub.get_message(timeout=deadline - time.monotonic())
            if message is not None and message["type"] == "subscribe":
                return
        raise redis.TimeoutError("no confirmation of the subscription to the request's channel")

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.expected)

    def poll(self, timeout: float) -> list[SampleTokens]:
        """What arrives within timeout (all that is waiting, once the first event is in); when nothing does,
        the ends recorded without their events."""
        if self._lost_at is not None:
            return self._reconnect(timeout)
        try:
            out = self._receive(timeout)
            return out or self.recover()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            logger.warning("request %s: lost Redis (%s); subscribing again", self.request_id, e)
            self._lost_at = time.monotonic()
            self.close()
            return []

    def _receive(self, timeout: float) -> list[SampleTokens]:
        out: list[SampleTokens] = []
        wait = max(timeout, 0.0)
        for _ in range(MAX_EVENTS_PER_POLL):
            message = self._pubsub.get_message(timeout=wait)
            if message is None:
                break
            wait = 0.0
            if message["type"] != "message":
                continue
            event = self._parse(message["data"])
            if event is not None:
                out.extend(self.accept(event))
        return out

    def _reconnect(self, timeout: float) -> list[SampleTokens]:
        """Subscribe again and catch up from the record; raises once the outage outlasts its grace."""
        assert self._lost_at is not None
        try:
            self._pubsub = self._client.pubsub()
            self._subscribe()
            known = self._client.exists(self._keys.request_meta(self.request_id))
        except redis.RedisError:
            self.close()
            down = time.monotonic() - self._lost_at
            if down > self._outage_grace_s:
                raise GenerationError(
                    ErrorCode.QUEUE_UNAVAILABLE, f"Redis has been unreachable for {down:.0f} s"
                ) from None
            time.sleep(max(0.0, min(timeout, RECONNECT_INTERVAL_S)))
            return []
        if not known:
            raise GenerationError(
                ErrorCode.QUEUE_UNAVAILABLE,
                "Redis came back without this request (it lost its data); send it again",
            )
        logger.info(
            "request %s: Redis is back after %.1f s", self.request_id, time.monotonic() - self._lost_at
        )
        self._lost_at = None
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
        return [self._deliver(index, token_ids, logprobs, event.finish_reason)]

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
        with contextlib.suppress(redis.RedisError):
            self._pubsub.close()  # drops the connection, and with it the subscription
