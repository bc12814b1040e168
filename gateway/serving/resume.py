"""Resuming a stream: event ids, and finding the request a client resumes.

Every event of a stream has the id `<request id>:<cursor>`, the cursor being, per sample (comma-separated),
how far the client is once it has the event: the number of the sample's tokens it covers, one more once the
sample's last chunk (its finish_reason) is sent, and two more for the usage chunk. A client that lost its
connection sends that id back (`Last-Event-ID`, or `starting_after` on the GET routes) and gets the rest of
the same generation: replayed from the token record, then live, for as long as the record lives.

A client may name its request (X-Request-Id): the name is the request's id, so that a client that never saw
the response can still fetch it, and its request is kept through the resume grace like a stream's.
"""

from __future__ import annotations

import re

import pydantic
import redis

from gateway.serving.errors import APIError, bad_request
from shared.errors import ErrorCode
from shared.keys import Keys
from shared.protocol import RequestMeta, decode

_CURSOR = re.compile(r"\d{1,9}(,\d{1,9}){0,127}")
REQUEST_ID_HEADER = "X-Request-Id"
# No ':' (it ends the id in an event id), no braces (a hash tag in the request's keys), nothing a URL escapes.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._~-]{1,128}")


def parse_request_id(value: str) -> str:
    """The id a client gives its request; 400 when it cannot be one."""
    if not _REQUEST_ID.fullmatch(value):
        raise bad_request(
            f"{REQUEST_ID_HEADER} must be 1 to 128 letters, digits, '.', '_', '~' or '-'",
            param=REQUEST_ID_HEADER,
        )
    return value


def request_id_in_use(request_id: str) -> APIError:
    return APIError(
        ErrorCode.REQUEST_ID_IN_USE,
        f"a request with the id '{request_id}' exists already: fetch it, or name a new one",
        param=REQUEST_ID_HEADER,
    )


def event_id(request_id: str, cursor: list[int]) -> str:
    return f"{request_id}:{','.join(map(str, cursor))}"


def parse_event_id(value: str, param: str = "Last-Event-ID") -> tuple[str, list[int]]:
    """The request id and cursor an event id names; 400 when it is not one."""
    request_id, _, cursor = value.strip().rpartition(":")
    if not request_id or not _CURSOR.fullmatch(cursor):
        raise bad_request(f"{param} must be an event id of a stream: '<request id>:<position>'", param=param)
    return request_id, [int(p) for p in cursor.split(",")]


def load_request(client: redis.Redis, keys: Keys, request_id: str, owner: str, *, chat: bool) -> RequestMeta:
    """The request a client resumes; 404 when it does not exist, has expired, belongs to another API key, or
    was made on the other endpoint."""
    data = client.get(keys.request_meta(request_id))
    try:
        meta = decode(RequestMeta, data) if isinstance(data, str) else None
    except pydantic.ValidationError:  # written by a gateway of another version
        meta = None
    if meta is None or meta.owner != owner or meta.chat != chat:
        raise APIError(
            ErrorCode.REQUEST_NOT_FOUND,
            f"no request '{request_id}' to resume here (it expired, or it is not this API key's)",
            param="id",
        )
    return meta


def check_cursor(meta: RequestMeta, cursor: list[int], param: str = "Last-Event-ID") -> None:
    if len(cursor) != meta.request.sampling.n:
        raise bad_request(
            f"{param} names {len(cursor)} samples; the request has {meta.request.sampling.n}", param
        )
