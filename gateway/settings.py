"""The gateway's settings, read from the environment (`python -m gateway --help` lists them)."""

from __future__ import annotations

from pydantic import Field

from shared.settings import CommonSettings


class ClientSettings(CommonSettings):
    """What the clients of the requests stream share: the gateway and the batch workers (gateway.batch)."""

    served_model_name: str = Field("SmolLM2-135M-Instruct", description="model id in the API")
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


class GatewaySettings(ClientSettings):
    """The REST gateway."""

    host: str = Field("127.0.0.1", description="address gunicorn binds")
    port: int = Field(8000, description="port gunicorn binds")
    gateway_workers: int = Field(2, description="gunicorn worker processes")
    api_keys: str = Field("", description="comma-separated accepted API keys; empty: no auth")
    max_queue_len: int = Field(1000, description="over this many queued requests, answer 503")
    max_body_bytes: int = Field(1 << 20, description="largest accepted request body")
    redis_max_connections: int = Field(
        64, description="Redis connections per gateway process; requests wait for one when all are busy"
    )
    sse_heartbeat_s: float = Field(5.0, description="seconds between SSE keep-alive comments")
    resume_grace_s: float = Field(
        10.0, description="a request whose client dropped is aborted if nobody resumes it within this long"
    )
    cors_allowed_origins: str = Field(
        "*", description="comma-separated origins browsers may call the API from; * for any, empty for none"
    )
    batch_max_file_bytes: int = Field(200 << 20, description="largest file POST /v1/files accepts")
    batch_max_lines: int = Field(50_000, description="most requests one batch file may hold")

    def api_key_set(self) -> set[str]:
        return {k.strip() for k in self.api_keys.split(",") if k.strip()}
