"""Engine configuration: one typed object, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    """Sizes and limits of one engine (one worker process)."""

    block_size: int = 16
    # KV pool size: an explicit block count wins, then a byte budget, then a fraction of free GPU memory.
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be positive")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
