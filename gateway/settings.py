"""The gateway's settings, read from the environment (`python -m gateway --help` lists them)."""

from __future__ import annotations

from pydantic import Field

from shared.settings import CommonSettings


class GatewaySettings(CommonSettings):
    """The REST gateway."""

    host: str = Field("127.0.0.1", description="address gunicorn binds")
    port: int = Field(8000, description="port gunicorn binds")
    gateway_workers: int = Field(2, description="gunicorn worker processes")
    served_model_name: str = Field("SmolLM2-135M-Instruct", description="model id in the API")
    api_keys: str = Field("", description="comma-separated accepted API keys; empty: no auth")
    max_queue_len: int = Field(1000, description="over this many queued requests, answer 503")
    max_body_bytes: int = Field(1 << 20, description="largest accepted request body")
    redis_max_connections: int = Field(
        64, description="Redis connections per gateway process; requests wait for one when all are busy"
    )
    sse_heartbeat_s: float = Field(5.0, description="seconds between SSE keep-alive comments")
    request_timeout_s: float = Field(600.0, description="give up on a request after this long")
    no_worker_grace_s: float = Field(
        5.0, description="a request in flight with no live worker for this long ends with 503 no_worker"
    )
    resume_grace_s: float = Field(
        10.0, description="a request whose client dropped is aborted if nobody resumes it within this long"
    )
    redis_outage_grace_s: float = Field(
        30.0, description="a request in flight fails (queue_unavailable) when Redis stays away this long"
    )
    cors_allowed_origins: str = Field(
        "*", description="comma-separated origins browsers may call the API from; * for any, empty for none"
    )
    max_model_len: int | None = Field(
        None, description="longest prompt + output in tokens (default and cap: the model's context)"
    )

    def api_key_set(self) -> set[str]:
        return {k.strip() for k in self.api_keys.split(",") if k.strip()}
