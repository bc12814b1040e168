"""Typed configuration of each service, read from the environment (the same names everywhere).

Every field is an environment variable of the same name in capitals (`redis_url` ← `REDIS_URL`); each
service's `--help` lists them, and a flag (`--redis-url`) overrides the variable for one run.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Sequence
from typing import TypeVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.keys import Keys


class CommonSettings(BaseSettings):
    """What every service needs: where Redis is, the key prefix, the model."""

    model_config = SettingsConfigDict(extra="ignore", case_sensitive=False, protected_namespaces=())

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis the services talk through")
    redis_prefix: str = Field("pagedserve", description="prefix of every Redis key")
    model: str | None = Field(None, description="model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    heartbeat_ttl_s: float = Field(5.0, description="a worker whose heartbeat is older than this is dead")
    request_ttl_s: int = Field(3600, description="lifetime of a request's token record and abort flag")
    log_level: str = Field("INFO", description="logging level")

    @property
    def keys(self) -> Keys:
        return Keys(self.redis_prefix)


class GatewaySettings(CommonSettings):
    """The REST gateway."""

    host: str = Field("127.0.0.1", description="address gunicorn binds")
    port: int = Field(8000, description="port gunicorn binds")
    gateway_workers: int = Field(2, description="gunicorn worker processes")
    served_model_name: str = Field("SmolLM2-135M-Instruct", description="model id in the API")
    api_keys: str = Field("", description="comma-separated accepted API keys; empty: no auth")
    max_queue_len: int = Field(1000, description="over this many queued requests, answer 503")
    max_body_bytes: int = Field(1 << 20, description="largest accepted request body")
    sse_heartbeat_s: float = Field(5.0, description="seconds between SSE keep-alive comments")
    request_timeout_s: float = Field(600.0, description="give up on a request after this long")
    max_model_len: int | None = Field(
        None, description="longest prompt + output in tokens (default and cap: the model's context)"
    )

    def api_key_set(self) -> set[str]:
        return {k.strip() for k in self.api_keys.split(",") if k.strip()}


class SchedulerSettings(CommonSettings):
    """The scheduler service."""

    watermark_blocks: int = Field(2, description="free blocks a worker keeps beyond an admitted prompt")
    max_running_per_worker: int = Field(256, description="assignments a worker may hold at once")
    poll_interval_s: float = Field(0.05, description="longest wait for new requests before re-checking")
    claim_idle_s: float = Field(
        5.0, description="requests a scheduler has not touched for this long are claimed by another"
    )


class WorkerSettings(CommonSettings):
    """One engine process (one accelerator)."""

    worker_id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}", description="unique worker name"
    )
    device: str | None = Field(None, description="cuda, cuda:N or cpu (default: cuda when present)")
    dtype: str = Field("auto", description="float32, bfloat16, float16 or auto")
    block_size: int = Field(16, description="tokens per KV block")
    num_kv_blocks: int | None = Field(None, description="KV pool size in blocks (overrides the budgets)")
    kv_cache_memory_bytes: int | None = Field(None, description="KV pool budget in bytes")
    gpu_memory_utilization: float = Field(0.9, description="fraction of free GPU memory for the KV pool")
    max_num_seqs: int = Field(256, description="sequences running at once")
    max_num_batched_tokens: int = Field(2048, description="tokens per engine step")
    enable_prefix_caching: bool = Field(True, description="share full blocks of common prefixes")
    heartbeat_interval_s: float = Field(1.0, description="seconds between heartbeats")


S = TypeVar("S", bound=CommonSettings)


def parse_settings(cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None) -> S:
    """Settings from the environment, overridden by command-line flags; `--help` lists every name."""
    parser = argparse.ArgumentParser(
        prog=prog, description=cls.__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for name, field in cls.model_fields.items():
        default = None if field.default_factory is not None else field.default
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=argparse.SUPPRESS,
            help=f"{field.description} [env {name.upper()}, default {default}]",
        )
    overrides = vars(parser.parse_args(argv))
    return cls(**overrides)
