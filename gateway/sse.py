"""The body of a streamed response: server-sent events, keep-alive comments, `data: [DONE]` at the end."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import redis

from gateway.errors import APIError
from gateway.generation import ClientDisconnected, Generation
from gateway.responses import ResponseFormat
from gateway.resume import event_id
from gateway.token_receiver import GenerationError
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

    Every chunk carries an event id (`<request id>:<cursor>`, gateway.resume) from which a client that lost
    its connection resumes. A client that has gone away shows up as a failed write: gunicorn then closes this
    generator, and the response's on-close callback lets the request go (gateway.attachments). The keep-alive
    comments sent while nothing happens are what make such a write happen.
    """
    rid = generation.request_id
    if not generation.resumed:
        for chunk in response_format.opening_chunks():
            yield sse(chunk, event_id(rid, response_format.cursor()))
    try:
        for changed in generation.updates():
            if not changed:
                yield KEEP_ALIVE
            for sample in changed:
                for chunk, cursor in response_format.sample_chunks(sample):
                    yield sse(chunk, event_id(rid, cursor))
    except ClientDisconnected:
        return
    except GenerationError as e:
        yield sse(APIError.of(e).body())
        yield DONE
        return
    except redis.RedisError as e:
        logger.warning("request %s: Redis failed mid-stream: %s", generation.request_id, e)
        yield sse(APIError(ErrorCode.QUEUE_UNAVAILABLE, "the request queue became unavailable").body())
        yield DONE
        return
    except Exception:
        logger.exception("request %s: failed mid-stream", generation.request_id)
        yield sse(APIError(ErrorCode.INTERNAL_ERROR, "internal server error").body())
        yield DONE
        return
    if generation.prepared.include_usage and not generation.usage_sent:
        chunk, cursor = response_format.usage_chunk()
        yield sse(chunk, event_id(rid, cursor))
    yield DONE
