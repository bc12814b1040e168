"""A request's body and credentials: JSON within the size limit, text that is text, checked by a schema
(gateway.serving.validation); the fields it ignored are named in the response's X-Ignored-Fields header."""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

import pydantic
from flask import Response, current_app, g, request
from werkzeug.exceptions import UnsupportedMediaType

from gateway.serving.errors import APIError, bad_request
from gateway.serving.validation import MAX_IGNORED_LISTED
from gateway.serving.validation import validate as checked
from shared.errors import ErrorCode

B = TypeVar("B", bound=pydantic.BaseModel)
IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
_SURROGATE = re.compile("[\ud800-\udfff]")
# Past this much of a refused body, the connection is closed instead.
DISCARD_LIMIT_BYTES = 64 << 20


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def json_body() -> dict[str, Any]:
    """The request's JSON object: 415 when it is not JSON, 413 when too large, 400 when malformed."""
    if not request.is_json:
        raise UnsupportedMediaType()
    data = _parse_json(_read_body(current_app.config["MAX_BODY_BYTES"]))
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", code=ErrorCode.INVALID_JSON)
    _check_text(data)
    return data


def _read_body(limit: int) -> bytes:
    """At most limit bytes of body, whether its length is declared or it comes in chunks."""
    declared = request.content_length
    raw = b"" if declared is not None and declared > limit else request.stream.read(limit + 1)
    if len(raw) > limit or (declared is not None and declared > limit):
        _discard(request.stream)
        raise APIError(ErrorCode.BODY_TOO_LARGE, f"the request body is larger than {limit} bytes")
    return raw


def _discard(stream: Any) -> None:
    """Read what is left of a refused body (up to a bound), so that a client still sending it gets the 413
    rather than a reset connection."""
    left = DISCARD_LIMIT_BYTES
    while left > 0 and (chunk := stream.read(min(left, 1 << 16))):
        left -= len(chunk)


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the body is not valid JSON: {e}", code=ErrorCode.INVALID_JSON) from e


def _check_text(value: Any) -> None:
    """JSON may escape half of a UTF-16 surrogate pair (`"\\ud800"`): such a string is no text to tokenize."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and _SURROGATE.search(item):
            raise bad_request("the body holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text")


def bearer_token() -> bytes | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else None


def validate(model: type[B], data: dict[str, Any]) -> B:
    """The body as the schema reads it; the fields it ignored are noted for the response's header."""
    body, ignored = checked(model, data, request.path)
    if ignored:
        g.ignored_fields = ignored
    return body


def ignored_fields_header(response: Response) -> Response:
    """After a request: name the fields its body held that were ignored."""
    ignored = g.get("ignored_fields")
    if ignored:
        response.headers[IGNORED_FIELDS_HEADER] = ", ".join(ignored[:MAX_IGNORED_LISTED])
    return response


def parse_body(model: type[B]) -> B:
    return validate(model, json_body())
