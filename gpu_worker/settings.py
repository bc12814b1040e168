"""The worker's settings: the engine's own options (EngineConfig) plus what the service adds.

`python -m gpu_worker --help` lists them. The engine's config is derived from them by `engine_config`, the one
place the two meet.
"""

from __future__ import annotations

import os
import secrets
import socket

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from gpu_worker.engine.config import EngineConfig
from shared.settings import CommonSettings, DrainSettings, ServedModelSettings


class WorkerSettings(CommonSettings, DrainSettings, ServedModelSettings, EngineConfig):
    """One engine process (one accelerator)."""

    model_config = SettingsConfigDict(
        extra="ignore", case_sensitive=False, protected_namespaces=(), validate_assignment=True
    )

    # New for every start: a container restarted as pid 1 on the same host name must not take over the id
    # (and the requests) of the process that died, which failover re-queues once its heartbeat lapses.
    worker_id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}",
        description="unique worker name (default: host-pid-random)",
    )
    device: str | None = Field(None, description="cuda, cuda:N or cpu (default: cuda when present)")
    dtype: str = Field(
        "auto",
        description="float32, bfloat16, float16 or auto (bfloat16 on a GPU or a CPU with bf16 instructions)",
    )
    heartbeat_interval_s: float = Field(1.0, description="seconds between heartbeats")
    resend_window_s: float = Field(
        10.0,
        ge=0,
        description="after Redis was away, write again what was written this many seconds before (a failover "
        "or a restart may have lost it); 0: never",
    )


def engine_config(settings: WorkerSettings, **overrides: object) -> EngineConfig:
    """The engine's config from the worker's settings (overrides win: a benchmark pinning the pool size)."""
    values = settings.model_dump(include=set(EngineConfig.model_fields))
    return EngineConfig.model_validate({**values, **overrides})
