"""The body of a streamed response: server-sent events, keep-alive comments, `data: [DONE]` at the end."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import redis

from gateway.serving.errors import APIError
from gateway.serving.generation import ClientDisconnected, Generation
from gateway.serving.prompt_batch import PromptBatch
from gateway.serving.responses import ResponseFormat
from gateway.serving.resume import event_id
from gateway.serving.token_receiver import GenerationError
from shared.errors import ErrorCode

logger = logging.getLogger(__name__)

# A comment line alone, with no blank line after it: a blank line ends an event, and a client that keeps the
# last event id (as the SSE spec has it) would take one after a comment for an event without data.
KEEP_ALIVE = ": keep-alive\n"
DONE = "data: [DONE]\n\n"


def sse(data: dict[str, Any], event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def event_stream(generation: Generation, response_format: ResponseFormat) -> Iterator[str]:
    """Chunks as the samples grow. A failure mid-stream becomes an error event (OpenAI's error object, with
    its code), then the stream ends.

    Every chunk carries an event id (`<request id>:<cursor>`, serving.resume), from which a client that lost
    its connection resumes. A client that has gone away shows up as a failed write: gunicorn then closes this
    generator, and the response's on-close callback lets the request go (serving.attachments). The keep-alive
    comments sent while nothing happens are what make such a write happen.
    """
    rid = generation.request_id
    if not generation.resumed:
        for chunk in response_format.opening_chunks():
            yield sse(chunk, event_id(rid, response_format.cursor()))
    yield from _ended(rid, _events(generation, response_format))


def _events(generation: Generation, response_format: ResponseFormat) -> Iterator[str]:
    rid = generation.request_id
    for changed in generation.updates():
        if not changed:
            yield KEEP_ALIVE
        for sample in changed:
            for chunk, cursor in response_format.sample_chunks(sample):
                yield sse(chunk, event_id(rid, cursor))
    if generation.prepared.include_usage and not generation.usage_sent:
        chunk, cursor = response_format.usage_chunk()
        yield sse(chunk, event_id(rid, cursor))


def batch_event_stream(batch: PromptBatch) -> Iterator[str]:
    """The stream of a request with several prompts: their chunks interleaved as they come, each choice
    indexed prompt_index * n + sample, and no event ids (resuming is for single-prompt streams)."""
    for chunk in batch.opening_chunks():
        yield sse(chunk)
    yield from _ended(batch.id, _batch_events(batch))


def _batch_events(batch: PromptBatch) -> Iterator[str]:
    for changed in batch.updates():
        if not changed:
            yield KEEP_ALIVE
        for index, sample in changed:
            for chunk in batch.sample_chunks(index, sample):
                yield sse(chunk)
    if batch.include_usage:
        yield sse(batch.usage_chunk())


def _ended(rid: str, events: Iterator[str]) -> Iterator[str]:
    """events, then `[DONE]`; a failure on the way ends them with an error event (a client gone: nothing)."""
    try:
        yield from events
    except ClientDisconnected:
        return
    except GenerationError as e:
        yield sse(APIError.of(e).body())
    except redis.RedisError as e:
        logger.warning("request %s: Redis failed mid-stream: %s", rid, e)
        yield sse(APIError(ErrorCode.QUEUE_UNAVAILABLE, "the request queue became unavailable").body())
    except Exception:
        logger.exception("request %s: failed mid-stream", rid)
        yield sse(APIError(ErrorCode.INTERNAL_ERROR, "internal server error").body())
    yield DONE
