"""The Batch API's records and names: files and batches as Redis keeps them, the Celery task that runs one.

A batch's record is a hash (shared.keys `batch:{bid}`): its fixed part (`spec`, a BatchSpec), its `status`,
one `<status>_at` timestamp per status it reached, the counts `total`, `completed` and `failed`, and
`output_file_id`, `error_file_id` and `errors` once known. The gateway and the batch workers both read and
write it; gateway.serving.batch_records is the one module that does.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field

from shared.protocol import WireModel

BatchStatus = Literal[
    "validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled"
]
ENDED_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
FilePurpose = Literal["batch", "batch_output"]

# The Celery task that runs a batch (by name: the gateway queues it without importing the worker side), and
# the queue it travels on.
RUN_BATCH_TASK = "pagedserve.run_batch"
BATCH_QUEUE = "batches"

_WINDOW = re.compile(r"(\d{1,7})([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 7 * 86400


class FileRecord(WireModel):
    """A stored file: what GET /v1/files/{id} shows."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose

    def api(self) -> dict[str, object]:
        return {"object": "file", **self.model_dump(exclude={"v"}), "status": "processed", "expires_at": None}


class BatchSpec(WireModel):
    """What a batch was created with; it never changes."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = Field(default=None)


def window_seconds(window: str) -> int | None:
    """A completion window's length (`24h`, `30m`, `90s`, `2d`), or None when it is not one we accept."""
    match = _WINDOW.fullmatch(window)
    if match is None:
        return None
    seconds = int(match.group(1)) * _UNIT_S[match.group(2)]
    return seconds if 0 < seconds <= MAX_WINDOW_S else None
