"""Engine configuration: one typed object, validated once at start-up.

Its fields are also the worker service's settings (gpu_worker.settings.WorkerSettings inherits them), so each
option has one name, one default and one description, whether it comes from `LLM(...)` or the environment.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpu_worker.engine.speculative import SpeculativeConfig


class EngineConfig(BaseModel):
    """Sizes and limits of one engine (one worker process)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    block_size: int = Field(default=16, description="tokens per KV block (8, 16 or 32)")
    # KV pool size: an explicit block count wins, then a byte budget, then a fraction of free GPU memory.
    num_kv_blocks: int | None = Field(
        default=None, ge=1, description="KV pool size in blocks (overrides the budgets)"
    )
    kv_cache_memory_bytes: int | None = Field(
        default=None, gt=0, description="KV pool budget in bytes (default on the CPU: 1 GiB)"
    )
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0.0, le=1.0, description="fraction of free GPU memory for the KV pool"
    )
    max_num_seqs: int = Field(default=256, ge=1, description="sequences running at once")
    max_num_batched_tokens: int = Field(default=2048, ge=1, description="tokens per engine step")
    max_model_len: int | None = Field(
        default=None,
        ge=2,
        description="longest prompt + output in tokens (default and cap: the model's context)",
    )
    enable_prefix_caching: bool = Field(default=True, description="share full blocks of common prefixes")
    seed: int = Field(default=0, description="seeds the sampling of requests that bring no seed of their own")
    model_impl: Literal["auto", "pagedserve", "transformers"] = Field(
        default="auto",
        description="the model's forward: pagedserve's own for Llama-family models (auto: where it applies), "
        "or transformers' modules with the paged attention",
    )
    speculative_config: SpeculativeConfig | None = Field(
        default=None,
        description='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} (default: off)',
    )

    @field_validator("block_size")
    @classmethod
    def _supported_block_size(cls, value: int) -> int:
        if value not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32, got {value}")
        return value
