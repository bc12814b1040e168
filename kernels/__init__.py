"""Paged KV-cache ops: the single import point the model runner uses.

Each op runs its CUDA kernel (kernels/csrc, built on first use) when its tensors are on a CUDA device, and its
pure-torch twin from kernels.reference otherwise or where no kernel is compiled for the shape; both share one
signature. On the CPU, decode attention in float32 and bfloat16 runs a C++ kernel (kernels/csrc/cpu, also
built on first use) when a compiler is at hand. Callers never import reference or the extensions directly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kernels import reference

__all__ = ["copy_blocks", "load", "paged_attention", "write_kv_cache"]

# Kept equal to PAGEDSERVE_FOR_EACH_HEAD_SIZE in csrc/paged_attention.h (a test compares them).
DECODE_HEAD_SIZES = (64, 80, 96, 112, 128, 256)
DECODE_BLOCK_SIZES = (8, 16, 32)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CPU_DTYPES = (torch.float32, torch.bfloat16)
# The CPU kernel's head size: a multiple of its vector width (kLanes in csrc/cpu/paged_attention_cpu.cpp).
CPU_HEAD_SIZE_MULTIPLE = 8


def _cuda_ops(t: Tensor) -> Any | None:
    if not t.is_cuda or t.dtype not in DTYPES:
        return None
    # Imported here, not above: `python -m kernels.build` must find the module not yet imported. The build
    # (or the load of a cached one) happens once per process, on the first op that sees a CUDA tensor.
    from kernels.build import load_extension

    return load_extension()


def _cpu_ops(t: Tensor) -> Any | None:
    if t.device.type != "cpu" or t.dtype not in CPU_DTYPES:
        return None
    from kernels.build import load_cpu_extension

    return load_cpu_extension()


def load(device: torch.device, dtype: torch.dtype) -> bool:
    """Build or load the compiled ops this device and dtype use, now rather than inside the first step.

    Returns whether compiled ops are in use; without them the pure-torch twins run.
    """
    probe = torch.empty(0, device=device, dtype=dtype)
    return (_cpu_ops(probe) if device.type == "cpu" else _cuda_ops(probe)) is not None


def write_kv_cache(
    key: Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: Tensor,  # [num_tokens, num_kv_heads, head_size]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Write each token's K/V into its cache slot, skipping tokens whose slot is -1."""
    ops = _cuda_ops(k_cache)
    if ops is None or key.stride(-1) != 1 or value.stride(-1) != 1:
        reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        return
    ops.write_kv_cache(key, value, k_cache, v_cache, slot_mapping.long())


def paged_attention(
    out: Tensor,  # [num_tokens, num_heads, head_size]
    query: Tensor,  # [num_tokens, num_heads, head_size]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table: Tensor,  # [num_seqs, max_num_blocks_per_seq] int32, -1 padded
    seq_lens: Tensor,  # [num_seqs] int32, cached context + this step's tokens
    query_start_loc: Tensor,  # [num_seqs + 1] int32, cumulative query lengths, each at least 1
    scale: float,
) -> None:
    """Causal attention of each sequence's new query tokens over its whole paged context, written into out."""
    args = (out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)
    decode = _decode_kernel(out, query, k_cache, block_table)
    if decode is None:
        reference.paged_attention(*args)
        return
    # The kernel takes the decodes and skips every sequence with more than one query token.
    decode(*args)
    # With one token per sequence there are no prefill chunks: known from shapes, without reading the device.
    if query.shape[0] != seq_lens.shape[0]:
        reference.prefill_attention(*args)


def _decode_kernel(out: Tensor, query: Tensor, k_cache: Tensor, block_table: Tensor) -> Any | None:
    """The compiled decode-attention op for these tensors (CUDA or CPU), or None where only the twin runs."""
    if query.stride(-1) != 1 or out.stride(-1) != 1:
        return None
    if query.device.type == "cpu":
        ops = _cpu_ops(k_cache)
        fits = query.dtype == out.dtype == k_cache.dtype and k_cache.shape[3] % CPU_HEAD_SIZE_MULTIPLE == 0
        fits = fits and block_table.is_contiguous()
    else:
        ops = _cuda_ops(query)
        fits = k_cache.shape[3] in DECODE_HEAD_SIZES and k_cache.shape[1] in DECODE_BLOCK_SIZES
    return ops.paged_attention_decode if ops is not None and fits else None


def copy_blocks(
    kv_cache: Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]
    block_mapping: Tensor,  # [num_pairs, 2] int64 of (src, dst); on CUDA no dst may also be a src
) -> None:
    """Copy block src to block dst for K and V in every layer (copy-on-write)."""
    ops = _cuda_ops(kv_cache)
    if ops is None or block_mapping.numel() == 0:
        reference.copy_blocks(kv_cache, block_mapping)
        return
    ops.copy_blocks(kv_cache, block_mapping.to(device=kv_cache.device, dtype=torch.long))
