"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`, for every failure.

The code (shared.errors.ErrorCode) decides the HTTP status and the OpenAI error type, through HTTP_ERRORS.
"""

from __future__ import annotations

import json
import logging
import math
import re
from http import HTTPStatus

import pydantic
import redis
from flask import Flask, Response, jsonify
from werkzeug.exceptions import HTTPException

from shared.errors import CodedError, ErrorCode

logger = logging.getLogger(__name__)

# code -> (HTTP status, OpenAI error type): the one place a failure's status is decided.
HTTP_ERRORS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorCode.INVALID_JSON: (400, "invalid_request_error"),
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error"),
    ErrorCode.KV_CAPACITY_EXCEEDED: (400, "invalid_request_error"),
    ErrorCode.INVALID_API_KEY: (401, "authentication_error"),
    ErrorCode.MODEL_NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.REQUEST_NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.FILE_NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.BATCH_NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.NOT_FOUND: (404, "not_found_error"),
    ErrorCode.METHOD_NOT_ALLOWED: (405, "invalid_request_error"),
    ErrorCode.BODY_TOO_LARGE: (413, "invalid_request_error"),
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: (415, "invalid_request_error"),
    ErrorCode.URI_TOO_LONG: (414, "invalid_request_error"),
    ErrorCode.HEADERS_TOO_LARGE: (431, "invalid_request_error"),
    ErrorCode.ENGINE_ERROR: (500, "server_error"),
    ErrorCode.PROTOCOL_ERROR: (500, "server_error"),
    ErrorCode.TOKENS_LOST: (500, "server_error"),
    ErrorCode.INTERNAL_ERROR: (500, "server_error"),
    ErrorCode.NO_WORKER: (503, "server_error"),
    ErrorCode.OVERLOADED: (503, "server_error"),
    ErrorCode.QUEUE_UNAVAILABLE: (503, "server_error"),
    ErrorCode.ABORTED: (503, "server_error"),
    ErrorCode.TIMEOUT: (504, "server_error"),
    ErrorCode.BATCH_EXPIRED: (504, "server_error"),
}

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


class APIError(CodedError):
    """An error the client sees: its code (which decides the HTTP status and OpenAI type) and the parameter
    at fault."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(code, message)
        self.status, self.type = HTTP_ERRORS[code]
        self.param = param
        self.retry_after = retry_after

    @classmethod
    def of(cls, error: CodedError) -> APIError:
        return error if isinstance(error, APIError) else cls(error.code, error.message)

    def body(self) -> dict[str, object]:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": str(self.code)}
        }

    def response(self) -> Response:
        response = jsonify(self.body())
        response.status_code = self.status
        if self.retry_after is not None:
            response.headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
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


def bad_request(
    message: str, param: str | None = None, code: ErrorCode = ErrorCode.INVALID_REQUEST
) -> APIError:
    return APIError(code, message, param=param)


def from_validation_error(error: pydantic.ValidationError) -> APIError:
    """The first problem of a request body, with the path to its parameter (`messages[0].role`)."""
    errors = error.errors(include_url=False)
    # A value matching no member of a union yields one error per member: the deepest one says most.
    first = max((e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]), key=lambda e: len(e["loc"]))
    param = _param_path(first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = f"unknown parameter '{param}'"
    elif first["type"] == "missing":
        message = f"missing required parameter '{param}'"
    elif param and first["type"] != "value_error":  # the gateway's own messages name what they check
        message = f"{param}: {message}"
    return bad_request(message, param=param or None)


def _param_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, str) and _UNION_TAG.search(part):
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else part
    return path


# pydantic names the member of a union in an error's location (`str`, `list[TextPart]`): not a parameter.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none)$|[\[\]-]")


def install_error_handlers(app: Flask) -> None:
    """Every error leaves as OpenAI-format JSON with a code; only a bug in the gateway is a 500."""

    @app.errorhandler(APIError)
    def _api_error(error: APIError) -> Response:
        return error.response()

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
        response = APIError(code, message or error.name).response()
        response.status_code = status
        if status == 405 and error.valid_methods:  # type: ignore[attr-defined]
            response.headers["Allow"] = ", ".join(error.valid_methods)  # type: ignore[attr-defined]
        return response

    @app.errorhandler(redis.RedisError)
    def _redis_error(error: redis.RedisError) -> Response:
        logger.warning("Redis unavailable: %s", error)
        return APIError(
            ErrorCode.QUEUE_UNAVAILABLE, "the request queue is unavailable", retry_after=1.0
        ).response()

    @app.errorhandler(Exception)
    def _bug(error: Exception) -> Response:
        logger.exception("unhandled error")
        return APIError(ErrorCode.INTERNAL_ERROR, "internal server error").response()
