"""Where the Batch API's file contents live: one small interface, and a local folder behind it.

A single host (or docker compose, where the folder is a volume both the gateway and the batch workers mount)
needs nothing more. Past one host the gateway and the workers need one store they all reach: an object store
(S3, GCS, ...) implementing the same three methods, chosen by `storage_at`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO, Protocol


class FileStorage(Protocol):
    """Bytes by file id: written once, read any number of times, deleted."""

    def write(self, file_id: str, chunks: Iterable[bytes]) -> int:
        """Store the chunks as the file's content, all or nothing; the number of bytes stored."""
        ...

    def open(self, file_id: str) -> BinaryIO:
        """The content to read; FileNotFoundError when there is none."""
        ...

    def delete(self, file_id: str) -> None:
        """Forget the content (nothing happens when there is none)."""
        ...


class LocalStorage:
    """File contents as files in one folder, written to a temporary name and renamed into place."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()

    def _path(self, file_id: str) -> Path:
        assert file_id.replace("-", "").replace("_", "").isalnum(), file_id  # ids are ours, never a path
        return self.root / file_id

    def write(self, file_id: str, chunks: Iterable[bytes]) -> int:
        size = 0
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
                    size += len(chunk)
            os.replace(tmp, self._path(file_id))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return size

    def open(self, file_id: str) -> BinaryIO:
        return self._path(file_id).open("rb")

    def delete(self, file_id: str) -> None:
        self._path(file_id).unlink(missing_ok=True)


def storage_at(location: str) -> FileStorage:
    """The storage a BATCH_STORAGE_DIR names (a folder; an object store would be named by its URL here)."""
    return LocalStorage(location)
