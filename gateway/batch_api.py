"""OpenAI's Files and Batches API on the gateway: upload a JSONL file, create a batch of it, follow it, cancel
it, download its results. The batch itself runs on the batch workers (gateway.batch.worker)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Literal

import redis
from flask import Response, jsonify, request
from kombu.exceptions import OperationalError
from pydantic import Field, field_validator

from gateway.request_body import parse_body
from gateway.serving.batch_files import FileStore, batch_file_lines
from gateway.serving.batch_queue import make_celery
from gateway.serving.batch_records import BatchRecord, BatchStore
from gateway.serving.body_model import Body
from gateway.serving.errors import APIError, bad_request
from gateway.serving.file_storage import storage_at
from gateway.settings import GatewaySettings
from shared.batches import BATCH_QUEUE, RUN_BATCH_TASK, BatchSpec, FileRecord, window_seconds
from shared.errors import ErrorCode

# A multipart upload carries a little more than its file: the boundaries and the other fields.
MULTIPART_SLACK_BYTES = 64 << 10
MAX_METADATA_KEYS = 16
DEFAULT_LIST_LIMIT = 20
MAX_LIST_LIMIT = 100
CANCELLABLE = frozenset({"validating", "in_progress"})


class CreateBatchBody(Body):
    """The body of POST /v1/batches."""

    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA_KEYS)

    @field_validator("completion_window")
    @classmethod
    def _window(cls, value: str) -> str:
        if window_seconds(value) is None:
            raise ValueError("must be a duration such as '24h', '30m' or '90s', of at most 7 days")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, text in (value or {}).items():
            if len(key) > 64 or len(text) > 512:
                raise ValueError("keys are at most 64 characters and values at most 512")
        return value


class BatchAPI:
    """The routes of /v1/files and /v1/batches, over the file and batch records."""

    def __init__(self, settings: GatewaySettings, client: redis.Redis) -> None:
        self._settings = settings
        self.files = FileStore(client, settings.keys, storage_at(settings.batch_storage_dir))
        self.batches = BatchStore(client, settings.keys, settings.batch_retention_s)
        self._celery = make_celery(settings)

    def routes(self) -> list[tuple[str, Callable[..., Any], list[str]]]:
        return [
            ("/v1/files", self.create_file, ["POST"]),
            ("/v1/files", self.list_files, ["GET"]),
            ("/v1/files/<file_id>", self.get_file, ["GET"]),
            ("/v1/files/<file_id>", self.delete_file, ["DELETE"]),
            ("/v1/files/<file_id>/content", self.file_content, ["GET"]),
            ("/v1/batches", self.create_batch, ["POST"]),
            ("/v1/batches", self.list_batches, ["GET"]),
            ("/v1/batches/<batch_id>", self.get_batch, ["GET"]),
            ("/v1/batches/<batch_id>/cancel", self.cancel_batch, ["POST"]),
        ]

    # -- files ----------------------------------------------------------------------------------------------

    def create_file(self) -> Response:
        limit = self._settings.batch_max_file_bytes
        request.max_content_length = limit + MULTIPART_SLACK_BYTES  # larger: 413 before it is read
        if not request.mimetype.startswith("multipart/form-data"):
            raise bad_request("upload the file as multipart/form-data, with fields `file` and `purpose`")
        purpose = request.form.get("purpose")
        if purpose != "batch":
            raise bad_request(f"purpose must be 'batch', not {purpose!r}", param="purpose")
        upload = request.files.get("file")
        if upload is None:
            raise bad_request("the upload has no `file` field", param="file")
        data = upload.read(limit + 1)
        if len(data) > limit:
            raise APIError(ErrorCode.BODY_TOO_LARGE, f"the file is larger than {limit} bytes")
        batch_file_lines(data, self._settings.batch_max_lines)
        record = self.files.create(upload.filename or "upload.jsonl", "batch", [data])
        return jsonify(record.api())

    def list_files(self) -> Response:
        after, limit = _page_args()
        records, has_more = self.files.page(after=after, limit=limit, purpose=request.args.get("purpose"))
        return _listing([r.api() for r in records], has_more)

    def get_file(self, file_id: str) -> Response:
        return jsonify(self._file(file_id).api())

    def delete_file(self, file_id: str) -> Response:
        if not self.files.delete(file_id):
            raise _no_file(file_id)
        return jsonify({"id": file_id, "object": "file", "deleted": True})

    def file_content(self, file_id: str) -> Response:
        self._file(file_id)
        try:
            handle = self.files.open(file_id)
        except FileNotFoundError as e:
            raise _no_file(file_id) from e
        return Response(_chunks(handle), mimetype="application/jsonl")

    def _file(self, file_id: str) -> FileRecord:
        record = self.files.get(file_id)
        if record is None:
            raise _no_file(file_id)
        return record

    # -- batches --------------------------------------------------------------------------------------------

    def create_batch(self) -> Response:
        body = parse_body(CreateBatchBody)
        source = self.files.get(body.input_file_id)
        if source is None:
            raise APIError(ErrorCode.FILE_NOT_FOUND, f"no file '{body.input_file_id}'", param="input_file_id")
        if source.purpose != "batch":
            raise bad_request(f"file '{source.id}' is not a batch input file", param="input_file_id")
        now = int(time.time())
        window = window_seconds(body.completion_window)
        assert window is not None
        spec = BatchSpec(
            id=f"batch_{uuid.uuid4().hex}",
            endpoint=body.endpoint,
            input_file_id=source.id,
            completion_window=body.completion_window,
            created_at=now,
            expires_at=now + window,
            metadata=body.metadata,
        )
        record = self.batches.create(spec)
        try:
            self._celery.send_task(RUN_BATCH_TASK, args=[spec.id], queue=BATCH_QUEUE)
        except (OperationalError, redis.RedisError) as e:
            with contextlib.suppress(redis.RedisError):
                self.batches.delete(spec.id)
            raise APIError(ErrorCode.QUEUE_UNAVAILABLE, f"the batch could not be queued: {e}") from e
        return jsonify(record.api())

    def list_batches(self) -> Response:
        after, limit = _page_args()
        records, has_more = self.batches.page(after=after, limit=limit)
        return _listing([r.api() for r in records], has_more)

    def get_batch(self, batch_id: str) -> Response:
        return jsonify(self._batch(batch_id).api())

    def cancel_batch(self, batch_id: str) -> Response:
        record = self._batch(batch_id)
        if record.status not in CANCELLABLE | {"cancelling", "cancelled"}:
            raise bad_request(f"batch '{batch_id}' has ended ({record.status}); it cannot be cancelled")
        self.batches.move(batch_id, CANCELLABLE, "cancelling")
        return jsonify(self._batch(batch_id).api())

    def _batch(self, batch_id: str) -> BatchRecord:
        record = self.batches.get(batch_id)
        if record is None:
            raise APIError(ErrorCode.BATCH_NOT_FOUND, f"no batch '{batch_id}'", param="batch_id")
        return record


def _no_file(file_id: str) -> APIError:
    return APIError(ErrorCode.FILE_NOT_FOUND, f"no file '{file_id}'", param="file_id")


def _page_args() -> tuple[str | None, int]:
    raw = request.args.get("limit", str(DEFAULT_LIST_LIMIT))
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise bad_request(f"limit must be a whole number from 1 to {MAX_LIST_LIMIT}", param="limit")
    return request.args.get("after"), int(raw)


def _listing(data: list[dict[str, Any]], has_more: bool) -> Response:
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return jsonify({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": has_more})


def _chunks(handle: Any, size: int = 1 << 16) -> Iterator[bytes]:
    with handle:
        while chunk := handle.read(size):
            yield chunk
