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
from shared.protocol import TokenEvent, TokenLogprob, WireError, decode
from shared.records import parse_ends, parse_tokens

logger = logging.getLogger(__name__)

SUBSCRIBE_TIMEOUT_S = 5.0
MAX_EVENTS_PER_POLL = 256


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
    """

    def __init__(self, client: redis.Redis, keys: Keys, request_id: str, num_samples: int) -> None:
        self._client = client
        self._keys = keys
        self.request_id = request_id
        self.expected = [0] * num_samples
        self.finished: dict[int, str] = {}
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
        """What arrives within timeout (all that is waiting, once the first event is in)."""
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
