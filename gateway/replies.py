"""How a generation's answer leaves the HTTP process: streamed as it comes, or waited for."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from flask import Response

from gateway.serving.errors import APIError
from gateway.serving.generation import ClientDisconnected
from gateway.serving.token_receiver import GenerationError


def streamed(events: Iterator[str], close: Callable[[], None]) -> Response:
    """A streamed response; close() runs when it ends, whether its client read it all or dropped."""
    response = Response(events, mimetype="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"  # a proxy in front must not buffer the stream
    response.call_on_close(close)
    return response


def waited(updates: Iterator[object], close: Callable[[], None]) -> Response | None:
    """Run updates to the end, then close(): None when it finished, a 499 when the client left (nobody reads
    it; the request goes unless resumed); a failure is raised as the client's error."""
    try:
        for _ in updates:
            pass
    except GenerationError as e:
        raise APIError.of(e) from e
    except ClientDisconnected:
        return Response(status=499)
    finally:
        close()
    return None
