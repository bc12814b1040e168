"""The gateway's settings, read from the environment (`python -m gateway --help` lists them)."""

from __future__ import annotations

from pydantic import Field

from gateway.serving.settings import ClientSettings


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
    response_ttl_s: int = Field(
        30 * 24 * 3600, description="a stored response (Responses API, store true) is kept this long"
    )
    response_store_max: int = Field(
        10_000, description="most responses stored at once; the oldest go first past it"
    )

    def api_key_set(self) -> set[str]:
        return {k.strip() for k in self.api_keys.split(",") if k.strip()}
