"""Error codes: one enum for every failure a client can see, whichever service noticed it.

A code travels with the error everywhere (exceptions, token events, the finished record); the gateway turns
it into an HTTP status and an OpenAI error type through one table (`gateway.serving.errors.HTTP_ERRORS`).
Nothing ever infers a code or a status from the words of a message.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """What went wrong, as the `code` of an OpenAI-format error."""

    # The request itself is at fault: it can never run as sent.
    INVALID_REQUEST = "invalid_request"  # a parameter is missing, of the wrong type or out of range
    INVALID_JSON = "invalid_json"  # the body is not a JSON object
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt (+ max_tokens) past the model's context
    KV_CAPACITY_EXCEEDED = "kv_capacity_exceeded"  # the prompt fits the context but no worker's KV pool
    MODEL_NOT_FOUND = "model_not_found"
    FILE_NOT_FOUND = "file_not_found"  # the Batch API's: no such file (or it was deleted)
    BATCH_NOT_FOUND = "batch_not_found"
    RESPONSE_NOT_FOUND = "response_not_found"  # the Responses API's: none stored by that id (for this key)
    REQUEST_NOT_FOUND = "request_not_found"  # a stream to resume that does not exist (or is another key's)
    REQUEST_ID_IN_USE = "request_id_in_use"  # X-Request-Id names a request that exists already
    INVALID_API_KEY = "invalid_api_key"
    NOT_FOUND = "not_found"  # no such endpoint
    METHOD_NOT_ALLOWED = "method_not_allowed"
    BODY_TOO_LARGE = "body_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    URI_TOO_LONG = "uri_too_long"
    HEADERS_TOO_LARGE = "headers_too_large"
    # The service cannot take the request now: retrying later may succeed.
    NO_WORKER = "no_worker"
    OVERLOADED = "overloaded"
    QUEUE_UNAVAILABLE = "queue_unavailable"  # Redis cannot be reached
    ABORTED = "aborted"  # the request was stopped by the service, not by its client
    TIMEOUT = "timeout"
    BATCH_EXPIRED = "batch_expired"  # a batch's line did not run within the batch's completion window
    # The service failed.
    ENGINE_ERROR = "engine_error"  # the engine raised while running the request
    PROTOCOL_ERROR = "protocol_error"  # a service received a message it cannot read
    TOKENS_LOST = "tokens_lost"  # tokens of a sample were neither received nor recorded
    INTERNAL_ERROR = "internal_error"


class CodedError(Exception):
    """An error that carries its code; the message is for people."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RequestRejected(CodedError, ValueError):
    """A request that can never run as asked (prompt too long, too large for the KV pool, bad ids)."""
