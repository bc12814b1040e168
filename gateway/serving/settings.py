"""What the clients of the requests stream share, read from the environment: the HTTP process and the batch
workers (their own settings add to these)."""

from __future__ import annotations

from pydantic import Field

from shared.settings import CommonSettings, ServedModelSettings


class ClientSettings(CommonSettings, ServedModelSettings):
    """What the gateway and the batch workers (gateway.batch) share."""

    request_timeout_s: float = Field(600.0, description="give up on a request after this long")
    no_worker_grace_s: float = Field(
        5.0, description="a request in flight with no live worker for this long ends with 503 no_worker"
    )
    redis_outage_grace_s: float = Field(
        30.0, description="a request in flight fails (queue_unavailable) when Redis stays away this long"
    )
    max_model_len: int | None = Field(
        None, description="longest prompt + output in tokens (default and cap: the model's context)"
    )
    batch_storage_dir: str = Field(
        "~/.local/share/pagedserve/files",
        description="folder of the Batch API's files, shared by the gateway and the batch workers",
    )
    batch_visibility_timeout_s: float = Field(
        300.0, description="a batch task whose Celery worker died runs again after this long"
    )
    batch_retention_s: int = Field(30 * 86400, description="a batch is listed for this long after it ends")
