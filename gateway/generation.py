"""One request seen from the gateway: subscribed, queued, its tokens turned into text, aborted when needed."""

from __future__ import annotations

import logging
import select
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis

from gateway import metrics
from gateway.output import SampleOutput
from gateway.token_receiver import GenerationError, SampleTokens, TokenReceiver
from gateway.tokenization import Tokenizer
from gateway.worker_watch import WorkerWatch
from shared.errors import ErrorCode
from shared.keys import REQUESTS_STREAM_MAXLEN, Keys
from shared.protocol import AbortMessage, GenerateRequest, RequestMeta, encode

logger = logging.getLogger(__name__)


class GenerationTimeout(GenerationError):
    """The request ran past the gateway's request timeout."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.TIMEOUT, message)


class ClientDisconnected(Exception):
    """The client closed its connection before the request finished."""


@dataclass(slots=True)
class Prepared:
    """A validated, tokenized request and what the gateway itself does with its output."""

    request: GenerateRequest
    chat: bool
    stop: list[str] = field(default_factory=list)
    prompt_text: str = ""
    echo: bool = False
    want_logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def meta(self, owner: str) -> RequestMeta:
        return RequestMeta(
            request=self.request,
            chat=self.chat,
            created=self.created,
            owner=owner,
            stop=self.stop,
            prompt_text=self.prompt_text,
            echo=self.echo,
            want_logprobs=self.want_logprobs,
            include_usage=self.include_usage,
        )


@dataclass(frozen=True, slots=True)
class Limits:
    """How long a request may take, and how long it waits out a missing worker or Redis."""

    timeout_s: float
    tick_s: float  # longest wait without news (a stream sends a keep-alive then)
    request_ttl_s: int
    no_worker_grace_s: float
    redis_outage_grace_s: float


def peer_closed(environ: dict[str, Any]) -> Callable[[], bool]:
    """Whether the client has closed its connection: it is readable and reading would give end-of-file.

    gunicorn puts the client socket in the WSGI environ; elsewhere (the test client) there is none.
    """
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return lambda: False

    def closed() -> bool:
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    return closed


class Generation:
    """Runs one request through the service and yields its samples as they change.

    The channel is subscribed before the request is queued, so no event can come before the gateway
    listens. A sample ended here by a stop string leaves its worker running; the request is aborted
    once every sample has ended (with n = 1, at once).
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        tokenizer: Tokenizer,
        prepared: Prepared,
        *,
        model_name: str,
        limits: Limits,
        watch: WorkerWatch | None = None,
        arrived: float | None = None,
        is_disconnected: Callable[[], bool] = lambda: False,
    ) -> None:
        self.request = prepared.request
        self.prepared = prepared
        self._client = client
        self._keys = keys
        self._labels = {"model_name": model_name}
        self._limits = limits
        self._watch = watch
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
            )
            for i in range(n)
        ]
        self._last_token_at: list[float | None] = [None] * n
        self._first_token_seen = False
        self.aborted: str | None = None
        self._receiver = TokenReceiver(
            client, keys, self.request.request_id, n, outage_grace_s=limits.redis_outage_grace_s
        )

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.samples)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    def submit(self, owner: str = "") -> None:
        """Queue the request, with the record of it a resumed stream reads (one MULTI)."""
        rid = self.request_id
        pipe = self._client.pipeline(transaction=True)
        pipe.set(
            self._keys.request_meta(rid), encode(self.prepared.meta(owner)), ex=self._limits.request_ttl_s
        )
        pipe.xadd(
            self._keys.requests,
            {"data": encode(self.request)},
            maxlen=REQUESTS_STREAM_MAXLEN,
            approximate=True,
        )
        pipe.execute()

    def updates(self) -> Iterator[list[SampleOutput]]:
        """Each batch of samples that changed; an empty list after every tick_s without events.

        Raises GenerationError (the request failed or timed out) and ClientDisconnected, after
        aborting the request.
        """
        while not self.done:
            now = time.monotonic()
            if now >= self._deadline:
                self.abort("timeout")
                limit = self._deadline - self._arrived
                raise GenerationTimeout(f"the request did not finish within {limit:g} s")
            if self._is_disconnected():
                self.abort("client_disconnect")
                raise ClientDisconnected(self.request_id)
            try:
                batch = self._receiver.poll(min(self._limits.tick_s, self._deadline - now))
                if not batch:
                    self._check_workers()
            except GenerationError:
                self.abort("error")
                raise
            if not batch:
                yield []
                continue
            changed = self._apply(batch)
            if self.done:
                self._finished()
            if changed:
                yield changed

    def _check_workers(self) -> None:
        """With no live worker for longer than the grace, the request ends as a new one would: no_worker."""
        if self._watch is None:
            return
        grace = self._limits.no_worker_grace_s
        if self._watch.seconds_without_worker() > grace:
            raise GenerationError(
                ErrorCode.NO_WORKER, f"no inference worker has been available for {grace:g} s; retry later"
            )

    def _apply(self, batch: list[SampleTokens]) -> list[SampleOutput]:
        changed: dict[int, SampleOutput] = {}
        for tokens in batch:
            sample = self.samples[tokens.index]
            if sample.finished:
                continue
            self._observe(tokens)
            sample.add(tokens)
            changed[sample.index] = sample
        return list(changed.values())

    def _observe(self, tokens: SampleTokens) -> None:
        if not tokens.token_ids:
            return
        if not self._first_token_seen:
            self._first_token_seen = True
            metrics.TIME_TO_FIRST_TOKEN.labels(**self._labels).observe(tokens.arrived_at - self._arrived)
        last = self._last_token_at[tokens.index]
        if last is not None:
            metrics.INTER_TOKEN_LATENCY.labels(**self._labels).observe(tokens.arrived_at - last)
        self._last_token_at[tokens.index] = tokens.arrived_at

    def _finished(self) -> None:
        metrics.E2E_REQUEST_LATENCY.labels(**self._labels).observe(time.monotonic() - self._arrived)
        for sample in self.samples:
            metrics.REQUEST_SUCCESS.labels(finished_reason=sample.finish_reason, **self._labels).inc()
        if any(s.stopped_here for s in self.samples) and not self._receiver.done:
            self.abort("stop")

    def abort(self, reason: str) -> None:
        """Tell the scheduler and the workers to drop the request (once; later calls do nothing)."""
        if self.aborted is not None:
            return
        self.aborted = reason
        rid = self.request_id
        try:
            pipe = self._client.pipeline(transaction=True)
            pipe.set(self._keys.abort_flag(rid), reason, ex=self._limits.request_ttl_s)
            pipe.publish(self._keys.aborts, encode(AbortMessage(request_id=rid, reason=reason)))
            pipe.execute()
        except redis.RedisError as e:
            logger.warning("request %s: could not publish its abort (%s): %s", rid, reason, e)

    def close(self, reason: str | None = "client_disconnect") -> None:
        """Release the subscription; a request that has not finished is aborted with reason (unless None)."""
        if reason is not None and not self.done:
            self.abort(reason)
        self._receiver.close()
