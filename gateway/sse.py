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
from gateway.token_receiver import GenerationError
from shared.errors import ErrorCode

logger = logging.getLogger(__name__)

KEEP_ALIVE = ": keep-alive\n\n"
DONE = "data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def event_stream(generation: Generation, response_format: ResponseFormat) -> Iterator[str]:
    """Chunks as the samples grow. A failure mid-stream becomes an error event (OpenAI's error object, with
    its code), then the stream ends.

    A client that has gone away shows up as a failed write: gunicorn then closes this generator, and
    the response's on-close callback aborts the request. The keep-alive comments sent while nothing
    happens are what make such a write happen.
    """
    for chunk in response_format.opening_chunks():
        yield sse(chunk)
    try:
        for changed in generation.updates():
            if not changed:
                yield KEEP_ALIVE
            for sample in changed:
                for chunk in response_format.sample_chunks(sample):
                    yield sse(chunk)
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
    if generation.prepared.include_usage:
        yield sse(response_format.usage_chunk())
    yield DONE
