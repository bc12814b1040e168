"""The batch workers' settings, read from the environment (`python -m gateway.batch --help` lists them)."""

from __future__ import annotations

from pydantic import Field

from gateway.serving.settings import ClientSettings


class BatchSettings(ClientSettings):
    """The batch workers: a Celery worker that runs the Batch API's batches."""

    batch_concurrency: int = Field(2, description="batches one batch worker runs at once (Celery threads)")
    batch_lines_in_flight: int = Field(
        16, description="most requests of one batch queued or running at once (the rest wait their turn)"
    )
    batch_priority: int = Field(
        100, description="priority of a batch's requests (lower runs first; interactive requests have 0)"
    )
    batch_slice_s: float = Field(
        60.0, description="a batch task hands its batch over to a fresh task after this long (at most)"
    )
