"""The scheduler's settings, read from the environment (`python -m scheduler_svc --help` lists them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.settings import CommonSettings, StatusSettings


class SchedulerSettings(CommonSettings, StatusSettings):
    """The scheduler service."""

    watermark_blocks: int = Field(2, description="free blocks a worker keeps beyond an admitted prompt")
    max_running_per_worker: int = Field(256, description="assignments a worker may hold at once")
    poll_interval_s: float = Field(0.05, description="longest wait for new requests before re-checking")
    view_refresh_s: float = Field(
        0.1, description="the workers' heartbeats are read at most this often (and after a refusal)"
    )
    routing_policy: Literal["prefix", "load"] = Field(
        "prefix",
        description="prefix: to the worker whose prefix cache holds most of the prompt, weighed against "
        "its free blocks; load: to the worker with the most free blocks",
    )
    claim_idle_s: float = Field(
        5.0, description="requests a scheduler has not touched for this long are claimed by another"
    )
