"""The OpenAPI 3 document of the gateway; request schemas come from the pydantic models themselves."""

from __future__ import annotations

from functools import cache
from importlib import metadata
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway.batch_api import CreateBatchBody
from gateway.serving.responses_api import ResponsesRequest
from gateway.serving.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

Json = dict[str, Any]


def _package_version() -> str:
    try:
        return metadata.version("pagedserve")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0.0.0"


VERSION = _package_version()

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _ref(name: str) -> Json:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: Json, description: str) -> Json:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Json]:
    meaning = {
        400: "invalid request",
        401: "missing or wrong API key",
        404: "unknown model, file, batch or stored response",
        409: "the X-Request-Id names a request that exists already",
        413: "body too large",
        415: "body is not JSON",
        500: "the generation failed",
        503: "overloaded or no worker (see Retry-After)",
        504: "the request timed out",
    }
    return {str(s): _json(_ref("Error"), meaning[s]) for s in statuses}


_RESUME_HEADER = {
    "name": "Last-Event-ID",
    "in": "header",
    "required": False,
    "description": (
        "the id of the last event a stream delivered (`<request id>:<cursor>`): the stream goes on after it, "
        "replayed from the request's record, then live; the body is not read"
    ),
    "schema": {"type": "string"},
}


_REQUEST_ID_HEADER = {
    "name": "X-Request-Id",
    "in": "header",
    "required": False,
    "description": (
        "the request's id, chosen by the client (1 to 128 of `A-Z a-z 0-9 . _ ~ -`; a prompt batch's "
        "are `<id>-<i>`): the response's `id`, and answered in the same header. A request named so is kept "
        "for the resume grace when its client goes, and can be fetched again by its id; an unnamed "
        "non-streamed request is aborted as soon as its client goes. 409 while a request of that id exists"
    ),
    "schema": {"type": "string", "pattern": "^[A-Za-z0-9._~-]{1,128}$"},
}


_IGNORED_FIELDS = {
    "X-Ignored-Fields": {
        "description": (
            "the fields of the body that the server does not know and ignored, as dotted paths "
            "(`foo, messages.0.bar`; the first 32); absent when there were none"
        ),
        "schema": {"type": "string"},
    }
}


def _post(
    summary: str, body: Json, ok: Json, *statuses: int, secured: bool = True, resumable: bool = False
) -> Json:
    operation: Json = {
        "summary": summary,
        "requestBody": {"required": not resumable, "content": {"application/json": {"schema": body}}},
        "responses": {"200": {**ok, "headers": _IGNORED_FIELDS}, **_errors(*statuses)},
    }
    if resumable:
        operation["parameters"] = [_RESUME_HEADER, _REQUEST_ID_HEADER]
    if secured:
        operation["security"] = [{"bearer": []}]
    return {"post": operation}


def _get(summary: str, ok: Json, *extra: tuple[int, str], secured: bool = False) -> Json:
    responses: Json = {"200": ok}
    for status, description in extra:
        responses[str(status)] = {"description": description}
    operation: Json = {"summary": summary, "responses": responses}
    if secured:
        operation["security"] = [{"bearer": []}]
    return {"get": operation}


_OBJECT = {"type": "object"}


def _retrieve(summary: str, ok: Json) -> Json:
    parameters = [
        {"name": "request_id", "in": "path", "required": True, "schema": {"type": "string"}},
        {
            "name": "stream",
            "in": "query",
            "required": False,
            "description": "true: server-sent events; false (the default): the whole response once finished",
            "schema": {"type": "boolean"},
        },
        {
            "name": "starting_after",
            "in": "query",
            "required": False,
            "description": "a stream's event id or its cursor: stream only what comes after it",
            "schema": {"type": "string"},
        },
    ]
    operation = {
        "summary": summary,
        "parameters": parameters,
        "responses": {"200": ok, **_errors(400, 401, 404, 500, 503, 504)},
        "security": [{"bearer": []}],
    }
    return {"get": operation}


_GENERATION_ERRORS = (400, 401, 404, 409, 413, 415, 500, 503, 504)


@cache
def _schemas() -> Json:
    models: list[type[BaseModel]] = [
        CompletionRequest,
        ChatCompletionRequest,
        TokenizeCompletionRequest,
        TokenizeChatRequest,
        DetokenizeRequest,
        CreateBatchBody,
        ResponsesRequest,
    ]
    _, top = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
    )
    return {**top["$defs"], "Error": _ERROR}


def _path_param(name: str) -> list[Json]:
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]


def _operation(summary: str, ok: str, *statuses: int, **extra: Any) -> Json:
    return {
        "summary": summary,
        "responses": {"200": _json(_OBJECT, ok), **_errors(*statuses)},
        "security": [{"bearer": []}],
        **extra,
    }


_PAGE = [
    {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
    {"name": "limit", "in": "query", "required": False, "schema": {"type": "integer"}},
]


def _batch_paths() -> Json:
    """The Batch API's routes (gateway.batch_api)."""
    upload = {
        "type": "object",
        "required": ["file", "purpose"],
        "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"const": "batch"}},
    }
    return {
        "/v1/files": {
            "post": _operation(
                "Upload a batch's requests (JSONL)",
                "the file",
                400,
                401,
                413,
                requestBody={"required": True, "content": {"multipart/form-data": {"schema": upload}}},
            ),
            "get": _operation("The files, newest first", "a page of files", 400, 401, parameters=_PAGE),
        },
        "/v1/files/{file_id}": {
            "get": _operation("One file", "the file", 401, 404),
            "delete": _operation("Delete a file", "the file, deleted", 401, 404),
            "parameters": _path_param("file_id"),
        },
        "/v1/files/{file_id}/content": {
            "get": _operation("A file's content", "the content", 401, 404),
            "parameters": _path_param("file_id"),
        },
        "/v1/batches": {
            "post": _operation(
                "Run a file's requests as a batch",
                "the batch",
                400,
                401,
                404,
                413,
                415,
                requestBody={
                    "required": True,
                    "content": {"application/json": {"schema": _ref("CreateBatchBody")}},
                },
            ),
            "get": _operation("The batches, newest first", "a page of batches", 400, 401, parameters=_PAGE),
        },
        "/v1/batches/{batch_id}": {
            "get": _operation("One batch, with its progress", "the batch", 401, 404),
            "parameters": _path_param("batch_id"),
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": _operation("Cancel a batch", "the batch", 400, 401, 404),
            "parameters": _path_param("batch_id"),
        },
    }


def _responses_paths() -> Json:
    """The Responses API's routes (gateway.responses_routes)."""
    streamed = {
        "description": "the response; with stream=true, its typed server-sent events (`event: response.*`)",
        "content": {
            "application/json": {"schema": _OBJECT},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }
    items_page = [
        *_PAGE,
        {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"]}},
    ]
    return {
        "/v1/responses": _post(
            "Create a response (stored unless store is false; background: answered at once, queued)",
            _ref("ResponsesRequest"),
            streamed,
            *_GENERATION_ERRORS,
        ),
        "/v1/responses/{response_id}": {
            "get": _operation("A stored response, as it stands", "the response", 400, 401, 404),
            "delete": _operation("Delete a stored response", "the response, deleted", 401, 404),
            "parameters": _path_param("response_id"),
        },
        "/v1/responses/{response_id}/cancel": {
            "post": _operation("Cancel a background response", "the response", 400, 401, 404),
            "parameters": _path_param("response_id"),
        },
        "/v1/responses/{response_id}/input_items": {
            "get": _operation(
                "A stored response's input items", "a page of items", 400, 401, 404, parameters=items_page
            ),
            "parameters": _path_param("response_id"),
        },
    }


def document(model_name: str) -> Json:
    streamed = {
        "description": "the result; with stream=true, server-sent events ending with `data: [DONE]`",
        "content": {
            "application/json": {"schema": _OBJECT},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }
    # A body with messages is a chat one (unknown fields such as a prompt beside them are ignored).
    tokenize_body = {"anyOf": [_ref("TokenizeCompletionRequest"), _ref("TokenizeChatRequest")]}
    paths = {
        "/v1/completions": _post(
            "Complete a prompt", _ref("CompletionRequest"), streamed, *_GENERATION_ERRORS, resumable=True
        ),
        "/v1/chat/completions": _post(
            "Answer a conversation",
            _ref("ChatCompletionRequest"),
            streamed,
            *_GENERATION_ERRORS,
            resumable=True,
        ),
        "/v1/completions/{request_id}": _retrieve(
            "A completion's output, or the rest of its stream", streamed
        ),
        "/v1/chat/completions/{request_id}": _retrieve(
            "A chat completion's output, or the rest of its stream", streamed
        ),
        "/v1/models": _get("The served model", _json(_OBJECT, "a list holding the model"), secured=True),
        "/v1/models/{model_id}": {
            **_get("One model", _json(_OBJECT, "the model"), (404, "unknown model"), secured=True),
            "parameters": [
                {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
            ],
        },
        "/tokenize": _post(
            "Token ids of a prompt or of a conversation's chat template",
            tokenize_body,
            _json(_OBJECT, "tokens, count, max_model_len and token_strs (null unless return_token_strs)"),
            *(400, 401, 413, 415),
        ),
        "/detokenize": _post(
            "Text of token ids", _ref("DetokenizeRequest"), _json(_OBJECT, "the text as `prompt`"), 400, 401
        ),
        "/health": _get("The process is alive", _json(_OBJECT, "ok")),
        "/ready": _get("Redis answers and a worker is live", _json(_OBJECT, "ready"), (503, "not ready")),
        "/metrics": _get(
            "Prometheus metrics (vLLM names)",
            {"description": "exposition text", "content": {"text/plain": {"schema": {"type": "string"}}}},
        ),
        "/dashboard": _get(
            "The KV pool dashboard (a page)",
            {"description": "HTML page", "content": {"text/html": {"schema": {"type": "string"}}}},
        ),
        "/dashboard/state": _get(
            "What the dashboard draws: workers with their block maps, the scheduler, routing decisions",
            _json(_OBJECT, "`now`, `workers`, `scheduler` and `routes`"),
            (503, "Redis unavailable"),
        ),
        "/openapi.json": _get("This document", _json(_OBJECT, "OpenAPI 3 document")),
        "/version": _get("The server's version", _json(_OBJECT, "`version`: the package's version")),
        **_batch_paths(),
        **_responses_paths(),
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "pagedserve",
            "version": VERSION,
            "description": f"OpenAI-compatible API serving {model_name} with PagedAttention.",
        },
        "paths": paths,
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
