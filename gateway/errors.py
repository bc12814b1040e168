"""The HTTP side of errors: every failure leaves as an OpenAI-format JSON response (gateway.serving.errors
decides its status and type), those gunicorn refuses itself included."""

from __future__ import annotations

import json
import logging
import math
from http import HTTPStatus

import redis
from flask import Flask, Response, jsonify
from werkzeug.exceptions import HTTPException

from gateway.serving.errors import APIError
from shared.errors import ErrorCode

logger = logging.getLogger(__name__)

# The errors werkzeug raises itself (routing, body size and type), by status.
_HTTP_EXCEPTIONS: dict[int, tuple[ErrorCode, str]] = {
    404: (ErrorCode.NOT_FOUND, "no such endpoint"),
    405: (ErrorCode.METHOD_NOT_ALLOWED, "method not allowed on this endpoint"),
    413: (ErrorCode.BODY_TOO_LARGE, "the request body is too large"),
    415: (ErrorCode.UNSUPPORTED_MEDIA_TYPE, "the request body must be JSON (Content-Type: application/json)"),
}


# What gunicorn refuses before the app sees it (past its limits on the request line and headers), by status.
_SERVER_REFUSALS: dict[int, tuple[ErrorCode, str]] = {
    414: (ErrorCode.URI_TOO_LONG, "the request line is too long"),
    431: (ErrorCode.HEADERS_TOO_LARGE, "the request's headers are too large"),
}


def error_response(error: APIError) -> Response:
    response = jsonify(error.body())
    response.status_code = error.status
    if error.retry_after is not None:
        response.headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
    return response


def raw_error_response(status: int, detail: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-format error, for requests gunicorn refuses itself."""
    code, message = _SERVER_REFUSALS.get(
        status, (ErrorCode.INVALID_REQUEST if status < 500 else ErrorCode.INTERNAL_ERROR, detail)
    )
    body = json.dumps(APIError(code, message or HTTPStatus(status).phrase).body()).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


def install_error_handlers(app: Flask) -> None:
    """Every error leaves as OpenAI-format JSON with a code; only a bug in the gateway is a 500."""

    @app.errorhandler(APIError)
    def _api_error(error: APIError) -> Response:
        return error_response(error)

    @app.errorhandler(HTTPException)
    def _http_error(error: HTTPException) -> Response:
        status = error.code or 500
        code, message = _HTTP_EXCEPTIONS.get(
            status,
            (
                ErrorCode.INVALID_REQUEST if status < 500 else ErrorCode.INTERNAL_ERROR,
                error.description or "",
            ),
        )
        response = error_response(APIError(code, message or error.name))
        response.status_code = status
        if status == 405 and error.valid_methods:  # type: ignore[attr-defined]
            response.headers["Allow"] = ", ".join(error.valid_methods)  # type: ignore[attr-defined]
        return response

    @app.errorhandler(redis.RedisError)
    def _redis_error(error: redis.RedisError) -> Response:
        logger.warning("Redis unavailable: %s", error)
        return error_response(
            APIError(ErrorCode.QUEUE_UNAVAILABLE, "the request queue is unavailable", retry_after=1.0)
        )

    @app.errorhandler(Exception)
    def _bug(error: Exception) -> Response:
        logger.exception("unhandled error")
        return error_response(APIError(ErrorCode.INTERNAL_ERROR, "internal server error"))
