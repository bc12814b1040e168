"""Errors in OpenAI's format, `{"error": {"message", "type", "param", "code"}}`, for every failure.

The code (shared.errors.ErrorCode) decides the HTTP status and the OpenAI error type, through HTTP_ERRORS: the
HTTP process answers with them, and the batch worker writes them into a batch's error lines.
"""

from __future__ import annotations

import re

import pydantic

from shared.errors import CodedError, ErrorCode

# code -> (HTTP status, OpenAI error type): the one place a failure's status is decided.
HTTP_ERRORS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorCode.INVALID_JSON: (400, "invalid_request_error"),
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error"),
    ErrorCode.KV_CAPACITY_EXCEEDED: (400, "invalid_request_error"),
    ErrorCode.INVALID_API_KEY: (401, "authentication_error"),
    ErrorCode.MODEL_NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.REQUEST_NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.RESPONSE_NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.REQUEST_ID_IN_USE: (409, "invalid_request_error"),
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


def bad_request(
    message: str, param: str | None = None, code: ErrorCode = ErrorCode.INVALID_REQUEST
) -> APIError:
    return APIError(code, message, param=param)


def from_validation_error(error: pydantic.ValidationError) -> APIError:
    """The first problem of a request body, with the path to its parameter (`messages[0].role`)."""
    errors = error.errors(include_url=False)
    # A value matching no member of a union yields one error per member: the deepest one says most.
    first = max((e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]), key=lambda e: len(e["loc"]))
    # A validator's own error may name the parameter at fault (shared.sampling's SamplingProblem does: a
    # combination is refused by the model, whose location names no field).
    # A model's validator may name its own field at fault (FieldProblem): the path goes on to it.
    problem = first.get("ctx", {}).get("error")
    field = getattr(problem, "field", None)
    loc = (*first["loc"], field) if field else first["loc"]
    param = getattr(problem, "param", None) or _param_path(loc)
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = f"unknown parameter '{param}'"
    elif first["type"] == "missing":
        message = f"missing required parameter '{param}'"
    elif param and first["type"] != "value_error":  # the gateway's own messages name what they check
        message = f"{param}: {message}"
    return bad_request(message, param=param or None)


class FieldProblem(ValueError):
    """A model validator's refusal of one of its own fields (the error's path goes on to the field)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


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
