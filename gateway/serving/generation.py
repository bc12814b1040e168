"""One request seen from the gateway: subscribed, queued, its tokens turned into text, aborted when needed."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import redis

from gateway.serving.attachments import Attachments
from gateway.serving.event_hub import EventHub
from gateway.serving.output import SampleOutput
from gateway.serving.prepare import Prepared
from gateway.serving.resume import request_id_in_use
from gateway.serving.settings import ClientSettings
from gateway.serving.token_receiver import GenerationError, SampleTokens, TokenReceiver
from gateway.serving.tokenization import Tokenizer
from gateway.serving.worker_watch import WorkerWatch
from shared.backoff import MAX_DELAY_S
from shared.errors import ErrorCode
from shared.keys import Keys
from shared.protocol import AbortMessage, GenerateRequest, encode
from shared.streams import queue_request

logger = logging.getLogger(__name__)


class GenerationTimeout(GenerationError):
    """The request ran past the gateway's request timeout."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.TIMEOUT, message)


class ClientDisconnected(Exception):
    """The client closed its connection before the request finished."""


@dataclass(frozen=True, slots=True)
class Limits:
    """How long a request may take, and how long it waits out a missing worker or Redis."""

    timeout_s: float
    tick_s: float  # longest wait without news (a stream sends a keep-alive then)
    request_ttl_s: int
    no_worker_grace_s: float
    redis_outage_grace_s: float

    @classmethod
    def of(cls, settings: ClientSettings, tick_s: float) -> Limits:
        """The limits a client of the requests stream (the gateway, a batch worker) is configured with."""
        return cls(
            timeout_s=settings.request_timeout_s,
            tick_s=tick_s,
            request_ttl_s=settings.request_ttl_s,
            no_worker_grace_s=settings.no_worker_grace_s,
            redis_outage_grace_s=settings.redis_outage_grace_s,
        )


class RequestObserver(Protocol):
    """What watches a request submitted here as it runs (the HTTP process's metrics)."""

    def tokens(self, tokens: SampleTokens) -> None: ...

    def finished(
        self, request: GenerateRequest, finish_reasons: list[str], num_output_tokens: int
    ) -> None: ...


class Generation:
    """Runs one request through the service and yields its samples as they change.

    The channel is subscribed before the request is queued, so no event can come before the gateway
    listens. A sample ended here by a stop string leaves its worker running; the request is aborted
    once every sample has ended (with n = 1, at once). A client that drops is not the end of the request:
    it is aborted only if nobody resumes it within the grace (serving.attachments). A resumed stream is a
    Generation too: instead of submitting, it replays what its client already has (replay()).
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        tokenizer: Tokenizer,
        prepared: Prepared,
        *,
        limits: Limits,
        hub: EventHub,
        watch: WorkerWatch | None = None,
        attachments: Attachments | None = None,
        arrived: float | None = None,
        is_disconnected: Callable[[], bool] = lambda: False,
        wakeup: threading.Event | None = None,
        observer: RequestObserver | None = None,
    ) -> None:
        self.request = prepared.request
        self.prepared = prepared
        self._client = client
        self._keys = keys
        self._limits = limits
        self._watch = watch
        self._attachments = attachments
        self._attachment: str | None = None
        self._renewed_at = 0.0
        self._closed = False
        self._owner = ""
        self.reattached = False  # a client attached to a request it did not submit here (no metrics)
        self.resumed = False  # ... and it has had part of the stream (no opening chunks)
        self.usage_sent = False  # ... all of it, up to the usage chunk
        self._arrived = time.monotonic() if arrived is None else arrived
        self._deadline = self._arrived + limits.timeout_s
        self._is_disconnected = is_disconnected
        n = self.request.sampling.n
        self.samples = [
            SampleOutput(
                i,
                tokenizer.detokenizer(self.request.prompt_token_ids),
                prepared.stop,
                prepared.want_logprobs,
                stop_token_ids=self.request.sampling.stop_token_ids,
                include_stop_str=prepared.include_stop_str_in_output,
            )
            for i in range(n)
        ]
        self._observer = observer
        self.aborted: str | None = None
        self._receiver = TokenReceiver(
            client,
            keys,
            self.request.request_id,
            n,
            hub=hub,
            outage_grace_s=limits.redis_outage_grace_s,
            wakeup=wakeup,
            resend=self._resend,
        )
        if attachments is not None:
            try:
                self._attachment = attachments.attach(self.request_id)
            except BaseException:
                self._receiver.close()
                raise

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.samples)

    @property
    def pending(self) -> bool:
        """Events have arrived that step() has not taken yet."""
        return self._receiver.pending

    @property
    def connected(self) -> bool:
        return self._receiver.connected

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    @property
    def deadline(self) -> float:
        """When the request times out (time.monotonic())."""
        return self._deadline

    def submit(
        self, owner: str = "", pipe: redis.client.Pipeline | None = None, *, exclusive: bool = False
    ) -> None:
        """Queue the request, with the record of it a resumed stream reads (one MULTI; with pipe, the caller's
        pipeline, which the caller executes), once its subscription is in place. exclusive: as
        queue_requests."""
        if pipe is None:
            queue_requests(self._client, [self], owner, exclusive=exclusive)
            return
        self._receiver.confirm()
        self._owner = owner
        self._queue_on(pipe, self.request)

    @property
    def meta_key(self) -> str:
        return self._keys.request_meta(self.request_id)

    def _queue_on(self, pipe: redis.client.Pipeline, request: GenerateRequest) -> None:
        """Queue on pipe: the record of the request a resumed stream reads, then the request itself."""
        meta = encode(self.prepared.meta(self._owner))
        pipe.set(self.meta_key, meta, ex=self._limits.request_ttl_s)
        queue_request(pipe, self._keys.requests, request)

    def _resend(self) -> None:
        """Queue the request again, for a Redis that came back without it: the samples still going, each
        resumed from the tokens it has streamed (recorded again, as its worker would have)."""
        going = [s for s in self.samples if not s.finished]
        request = self.request.model_copy(
            update={"samples": [s.index for s in going], "resume": {s.index: s.token_ids for s in going}}
        )
        pipe = self._client.pipeline(transaction=True)
        for sample in going:
            if sample.token_ids:
                key = self._keys.tokens(self.request_id, sample.index)
                pipe.delete(key)
                pipe.rpush(key, *sample.token_ids)
                pipe.expire(key, self._limits.request_ttl_s)
        self._queue_on(pipe, request)
        pipe.execute()

    def updates(self) -> Iterator[list[SampleOutput]]:
        """Each batch of samples that changed; an empty list after every tick_s without events.

        Raises GenerationError (the request failed or timed out) and ClientDisconnected, after
        aborting the request. A resumed stream starts with every sample: what the replay left untaken.
        """
        if self.reattached:
            yield list(self.samples)
        while not self.done:
            changed = self.step(self._limits.tick_s)
            if changed is None:
                yield []
            elif changed:
                yield changed

    def step(self, wait_s: float) -> list[SampleOutput] | None:
        """Take the events that arrive within wait_s: the samples they changed, or None when none came.

        Raises as updates() does.
        """
        now = time.monotonic()
        if now >= self._deadline:
            self.abort("timeout")
            limit = self._deadline - self._arrived
            raise GenerationTimeout(f"the request did not finish within {limit:g} s")
        if self._is_disconnected():
            self.close()
            raise ClientDisconnected(self.request_id)
        self._renew(now)
        try:
            batch = self._receiver.poll(min(wait_s, self._deadline - now))
            if not batch and self._receiver.connected:  # (a Redis away has a grace of its own)
                self._check_workers()
        except GenerationError:
            self.abort("error")
            raise
        if not batch:
            return None
        changed = self._apply(batch)
        if self.done:
            self._finished()
        return changed

    def replay(self, cursor: list[int] | None) -> None:
        """Attach to the request as it is: feed what the client already has (cursor: per sample, the position
        it reached; None: nothing) through the samples silently, from the token record; the rest follows."""
        self.resumed = cursor is not None
        self.reattached = True
        cursor = cursor or [0] * len(self.samples)
        tokens, ends = self._receiver.record()
        for sample, reached, recorded in zip(self.samples, cursor, tokens):
            fed = min(reached, len(recorded))
            sample.add(SampleTokens(sample.index, recorded[:fed], [None] * fed))
            sample.take()  # the same text the client got: it holds back what it held back then
            end = ends.get(sample.index)
            if (
                reached > sample.num_tokens
                and not sample.finished
                and end is not None
                and fed == len(recorded)
            ):
                sample.add(SampleTokens(sample.index, [], [], end.finish_reason))  # it had the end too
                sample.take()
            if reached > sample.num_tokens and sample.finished:
                sample.take_finish()
            self._receiver.skip(sample.index, fed, sample.finish_reason)
        # The usage chunk's event id is one past every sample's end (gateway.serving.responses.usage_chunk).
        self.usage_sent = self.resumed and all(
            s.finished and reached > s.position for s, reached in zip(self.samples, cursor)
        )
        self._apply(self._receiver.catch_up())

    def _renew(self, now: float) -> None:
        if self._attachments is None or self._attachment is None:
            return
        if now - self._renewed_at >= self._attachments.lease_s / 3:
            self._renewed_at = now
            with contextlib.suppress(redis.RedisError):  # a Redis away: the receiver handles that
                self._attachments.renew(self.request_id, self._attachment)

    def _check_workers(self) -> None:
        """With no live worker for longer than the grace, the request ends as a new one would: no_worker."""
        if self._watch is None:
            return
        grace = self._limits.no_worker_grace_s
        # Redis back after an outage (empty, perhaps): each worker registers again once its own backoff
        # ends, at most MAX_DELAY_S later, so the grace runs from then.
        without = min(self._watch.seconds_without_worker(), self._receiver.back_for - MAX_DELAY_S)
        if without > grace:
            raise GenerationError(
                ErrorCode.NO_WORKER, f"no inference worker has been available for {grace:g} s; retry later"
            )

    def _apply(self, batch: list[SampleTokens]) -> list[SampleOutput]:
        changed: dict[int, SampleOutput] = {}
        for tokens in batch:
            sample = self.samples[tokens.index]
            if sample.finished:
                continue
            if self._observer is not None and not self.reattached:  # a re-read stream's are not the request's
                self._observer.tokens(tokens)
            sample.add(tokens)
            changed[sample.index] = sample
        return list(changed.values())

    def _finished(self) -> None:
        if self._observer is not None and not self.reattached:
            reasons = [s.finish_reason or "" for s in self.samples]
            self._observer.finished(self.request, reasons, self.num_completion_tokens)
        if any(s.stopped_here for s in self.samples) and not self._receiver.done:
            self.abort("stop")

    def abort(self, reason: str) -> None:
        """Tell the scheduler and the workers to drop the request (once; later calls do nothing)."""
        if self.aborted is not None:
            return
        self.aborted = reason
        abort_request(self._client, self._keys, self.request_id, reason, self._limits.request_ttl_s)

    def _abort_unless_finished(self, reason: str) -> None:
        """abort(), unless every sample has ended meanwhile (its worker went on without the client)."""
        try:
            if self._client.hlen(self._keys.finished(self.request_id)) >= len(self.samples):
                return
        except redis.RedisError as e:  # the request finishes on its own, or times out on its worker
            logger.warning("request %s: could not read whether it finished: %s", self.request_id, e)
            return
        self.abort(reason)

    def close(self, reason: str | None = "client_disconnect") -> None:
        """Release the subscription and the attachment (once; later calls do nothing). A request that has not
        finished is aborted with reason (None: not at all): at once, or, when its client dropped and others
        may resume it, after the resume grace unless one has."""
        if self._closed:
            return
        self._closed = True
        attachments, attachment = self._attachments, self._attachment
        if reason is not None and not self.done and self.aborted is None:
            if attachments is not None and attachment is not None and reason == "client_disconnect":
                attachments.detach_and_abort_later(
                    self.request_id, attachment, lambda: self._abort_unless_finished(reason)
                )
                attachment = None
            else:
                self.abort(reason)
        if attachments is not None and attachment is not None:
            with contextlib.suppress(redis.RedisError):
                attachments.detach(self.request_id, attachment)
        self._receiver.close()


def abort_request(client: redis.Redis, keys: Keys, rid: str, reason: str, ttl_s: int) -> None:
    """Tell the scheduler and the workers to drop a request: its abort flag, then the word to the workers (a
    Redis away: logged; the request finishes or times out on its worker)."""
    try:
        pipe = client.pipeline(transaction=True)
        pipe.set(keys.abort_flag(rid), reason, ex=ttl_s)
        pipe.publish(keys.aborts, encode(AbortMessage(request_id=rid, reason=reason)))
        pipe.execute()
    except redis.RedisError as e:
        logger.warning("request %s: could not publish its abort (%s): %s", rid, reason, e)


def queue_requests(
    client: redis.Redis, generations: Sequence[Generation], owner: str, *, exclusive: bool = False
) -> None:
    """Queue the requests of generations at once (one MULTI): all of them or none. exclusive, for ids a client
    chose: only if none of them names a request that exists (409 request_id_in_use otherwise, also when one
    is created meanwhile)."""
    with client.pipeline(transaction=True) as pipe:
        if exclusive:
            metas = [g.meta_key for g in generations]
            pipe.watch(*metas)
            if pipe.exists(*metas):
                known = next(g.request_id for g in generations if pipe.exists(g.meta_key))
                raise request_id_in_use(known)
            pipe.multi()
        for generation in generations:
            generation.submit(owner, pipe)
        try:
            pipe.execute()
        except redis.WatchError as e:
            raise request_id_in_use(generations[0].request_id) from e
