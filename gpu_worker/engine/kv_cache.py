"""The paged KV pool: one tensor holding every layer's K and V blocks."""

from __future__ import annotations

import torch

import kernels
from gpu_worker.engine.config import EngineConfig
from gpu_worker.engine.huge_pages import advise_huge_pages


class KVCache:
    """`kv_cache[layer, 0 | 1]` is that layer's K | V: [num_blocks, block_size, num_kv_heads, head_size]."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_size)
        self.kv_cache = torch.empty(shape, dtype=dtype, device=device)
        advise_huge_pages(self.kv_cache)  # before the zeros first touch it
        self.kv_cache.zero_()
        self.layers = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(num_layers)]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_size * dtype.itemsize

    @staticmethod
    def num_blocks_for(config: EngineConfig, bytes_per_block: int, device: torch.device) -> int:
        """Pool size: an explicit block count, else a byte budget, else a fraction of free GPU memory."""
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_memory_bytes is not None:
            budget = config.kv_cache_memory_bytes
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * config.gpu_memory_utilization)
        else:
            budget = 1 << 30  # 1 GiB of host memory by default on the CPU
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {budget} bytes holds no block of {bytes_per_block} bytes")
        return num_blocks

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy each (src, dst) block in every layer, before the step's forward pass."""
        if pairs:
            mapping = torch.tensor(pairs, dtype=torch.int64, device=self.kv_cache.device)
            kernels.copy_blocks(self.kv_cache, mapping)
