"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`, for every failure."""

from __future__ import annotations

import logging
import math
import re

import pydantic
import redis
from flask import Flask, Response, jsonify
from werkzeug.exceptions import HTTPException

logger = logging.getLogger(__name__)

# A worker or the scheduler refused the request itself (it can never run), not a failure of the service.
_REQUEST_FAULT = re.compile(r"fit|max_model_len|context|must be|empty|too long|exceeds", re.IGNORECASE)


class APIError(Exception):
    """An error the client sees: HTTP status, OpenAI error type, and the parameter at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        response = jsonify(self.body())
        response.status_code = self.status
        if self.retry_after is not None:
            response.headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return response


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def overloaded(message: str, retry_after: float, code: str) -> APIError:
    return APIError(503, message, type="server_error", code=code, retry_after=retry_after)


def generation_failed(message: str) -> APIError:
    """A worker or the scheduler answered with an error: 400 when the request can never run, else 500."""
    if _REQUEST_FAULT.search(message):
        return APIError(400, message, code="request_not_servable")
    return APIError(500, message, type="server_error", code="generation_failed")


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

_HTTP_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


def install_error_handlers(app: Flask) -> None:
    """Every error leaves as OpenAI-format JSON; only a bug in the gateway is a 500."""

    @app.errorhandler(APIError)
    def _api_error(error: APIError) -> Response:
        return error.response()

    @app.errorhandler(HTTPException)
    def _http_error(error: HTTPException) -> Response:
        status = error.code or 500
        messages = {
            404: "no such endpoint",
            405: "method not allowed on this endpoint",
            413: "the request body is too large",
            415: "the request body must be JSON (Content-Type: application/json)",
        }
        message = messages.get(status, error.description or error.name)
        kind = _HTTP_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        response = APIError(status, message, type=kind).response()
        if status == 405 and error.valid_methods:  # type: ignore[attr-defined]
            response.headers["Allow"] = ", ".join(error.valid_methods)  # type: ignore[attr-defined]
        return response

    @app.errorhandler(redis.RedisError)
    def _redis_error(error: redis.RedisError) -> Response:
        logger.warning("Redis unavailable: %s", error)
        return overloaded("the request queue is unavailable", 1.0, "queue_unavailable").response()

    @app.errorhandler(Exception)
    def _bug(error: Exception) -> Response:
        logger.exception("unhandled error")
        return APIError(500, "internal server error", type="server_error").response()
