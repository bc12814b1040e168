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
from shared.errors import ErrorCode
from shared.keys import REQUESTS_STREAM_MAXLEN, Keys
from shared.protocol import AbortMessage, GenerateRequest, encode

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
    stop: list[str] = field(default_factory=list)
    prompt_text: str = ""
    echo: bool = False
    want_logprobs: bool = False
    stream: bool = False
    include_usage: bool = False


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
        request_ttl_s: int,
        timeout_s: float,
        tick_s: float,
        arrived: float | None = None,
        is_disconnected: Callable[[], bool] = lambda: False,
    ) -> None:
        self.request = prepared.request
        self.prepared = prepared
        self._client = client
        self._keys = keys
        self._labels = {"model_name": model_name}
        self._request_ttl_s = request_ttl_s
        self._tick_s = tick_s
        self._arrived = time.monotonic() if arrived is None else arrived
        self._deadline = self._arrived + timeout_s
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
        self._receiver = TokenReceiver(client, keys, self.request.request_id, n)

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

    def submit(self) -> None:
        self._client.xadd(
            self._keys.requests,
            {"data": encode(self.request)},
            maxlen=REQUESTS_STREAM_MAXLEN,
            approximate=True,
        )

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
                batch = self._receiver.poll(min(self._tick_s, self._deadline - now))
                if not batch:
                    batch = self._receiver.recover()
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
            pipe.set(self._keys.abort_flag(rid), reason, ex=self._request_ttl_s)
            pipe.publish(self._keys.aborts, encode(AbortMessage(request_id=rid, reason=reason)))
            pipe.execute()
        except redis.RedisError as e:
            logger.warning("request %s: could not publish its abort (%s): %s", rid, reason, e)

    def close(self, reason: str | None = "client_disconnect") -> None:
        """Release the subscription; a request that has not finished is aborted with reason (unless None)."""
        if reason is not None and not self.done:
            self.abort(reason)
        self._receiver.close()
