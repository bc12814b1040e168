"""The Batch API's files: contents in a FileStorage, records in Redis, and what a batch file must be."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO, cast

import pydantic
import redis

from gateway.serving.errors import bad_request
from gateway.serving.file_storage import FileStorage
from shared.batches import FilePurpose, FileRecord
from shared.keys import Keys
from shared.protocol import decode, encode


class FileStore:
    """Files by id: their content in the storage, their record (FileRecord) and a listing in Redis."""

    def __init__(self, client: redis.Redis, keys: Keys, storage: FileStorage) -> None:
        self._client = client
        self._keys = keys
        self._storage = storage

    def create(self, filename: str, purpose: FilePurpose, chunks: Iterable[bytes]) -> FileRecord:
        file_id = f"file-{uuid.uuid4().hex}"
        size = self._storage.write(file_id, chunks)
        record = FileRecord(
            id=file_id, bytes=size, created_at=int(time.time()), filename=filename, purpose=purpose
        )
        # Listed first, then written: the listing is on a slot of its own (UNLISTED_GRACE_S).
        pipe = self._client.pipeline(transaction=False)
        pipe.zadd(self._keys.files, {file_id: time.time()})
        pipe.set(self._keys.file(file_id), encode(record))
        pipe.execute()
        return record

    def get(self, file_id: str) -> FileRecord | None:
        data = self._client.get(self._keys.file(file_id))
        try:
            return decode(FileRecord, data) if isinstance(data, str | bytes) else None
        except pydantic.ValidationError:
            return None

    def page(
        self, *, after: str | None, limit: int, purpose: str | None = None
    ) -> tuple[list[FileRecord], bool]:
        """Newest first, from just past `after`: up to limit records, and whether more follow."""
        return listing_page(self._client, self._keys.files, after, limit, self.get, purpose)

    def open(self, file_id: str) -> BinaryIO:
        return self._storage.open(file_id)

    def delete(self, file_id: str) -> bool:
        """Whether there was such a file."""
        pipe = self._client.pipeline(transaction=False)  # the record, then its listing
        pipe.delete(self._keys.file(file_id))
        pipe.zrem(self._keys.files, file_id)
        existed = bool(pipe.execute()[0])
        if existed:  # (an id from a record is one of ours; any other never reaches the storage)
            self._storage.delete(file_id)
        return existed


# A listing (a zset of ids by creation time) and the records it lists are on different Redis Cluster slots, so
# no MULTI holds both: a record is listed before it is written and unlisted after it is deleted, and a member
# whose record is missing is dropped from the listing once it is this old (a write that failed between the
# two, or a batch past its retention), never while its record may still be on its way.
UNLISTED_GRACE_S = 60.0


def listing_page(
    client: redis.Redis,
    listing: str,
    after: str | None,
    limit: int,
    get: Callable[[str], Any],
    purpose: str | None = None,
) -> tuple[list[Any], bool]:
    """A page of a listing (a zset by creation time, newest first) after the id `after`: up to limit records
    and whether more follow. Members whose record has gone (a batch past its retention) leave the listing,
    once past UNLISTED_GRACE_S."""
    members = cast(list[tuple[str, float]], client.zrevrange(listing, 0, -1, withscores=True))
    listed_at = {str(one): score for one, score in members}
    ids = list(listed_at)
    start = 0
    if after is not None:
        if after not in ids:
            raise bad_request(f"no such id to list after: '{after}'", param="after")
        start = ids.index(after) + 1
    found: list[Any] = []
    gone = []
    for one in ids[start:]:
        record = get(one)
        if record is None:
            if listed_at[one] < time.time() - UNLISTED_GRACE_S:
                gone.append(one)
        elif purpose is None or getattr(record, "purpose", None) == purpose:
            found.append(record)
            if len(found) > limit:
                break
    if gone:
        client.zrem(listing, *gone)
    return found[:limit], len(found) > limit


def batch_file_lines(data: bytes, max_lines: int) -> list[str]:
    """The requests of an uploaded batch file, one JSON line each; 400 naming the first line that makes the
    whole file unusable: not UTF-8, a `custom_id` seen before, or one line too many. A line that is merely a
    bad request (not JSON, the wrong url, an invalid body) is kept: the batch answers it in its error file."""
    lines: list[str] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            raise bad_request(f"line {number} of the file is not UTF-8 text: {e}", param="file") from e
        if not line:
            continue
        if len(lines) == max_lines:
            raise bad_request(f"line {number}: a batch file holds at most {max_lines} requests", param="file")
        custom_id = custom_id_of(line)
        if custom_id is not None:
            if custom_id in seen:
                raise bad_request(
                    f"line {number}: custom_id '{custom_id}' is already used by line {seen[custom_id]};"
                    " each request of a batch needs its own",
                    param="file",
                )
            seen[custom_id] = number
        lines.append(line)
    if not lines:
        raise bad_request("the file holds no requests (one JSON object per line)", param="file")
    return lines


def custom_id_of(line: str) -> str | None:
    """The line's custom_id, when it is a JSON object that has a string one."""
    try:
        data = json.loads(line)
    except ValueError:
        return None
    value = data.get("custom_id") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def read_lines(handle: BinaryIO) -> Iterator[str]:
    """A stored batch file's request lines (as batch_file_lines kept them: non-blank)."""
    with handle:
        for raw in handle:
            line = raw.decode("utf-8").strip()
            if line:
                yield line
