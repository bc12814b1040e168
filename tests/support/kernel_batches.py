"""Batches for the kernel tests: a step's flat batch of queries over a paged KV cache, with the dense K/V
it was built from (for the reference computed from scratch)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor


def slot_of(row: list[int], pos: int, block_size: int) -> int:
    """Physical slot of token pos of a sequence whose block-table row is row."""
    return row[pos // block_size] * block_size + pos % block_size


@dataclass
class Batch:
    """One step's flat batch plus the dense per-sequence K/V it was built from."""

    query: Tensor  # [num_tokens, num_heads, head_size]
    key: Tensor  # [num_tokens, num_kv_heads, head_size]
    value: Tensor  # [num_tokens, num_kv_heads, head_size]
    k_cache: Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table: Tensor  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: Tensor  # [num_seqs] int32
    query_start_loc: Tensor  # [num_seqs + 1] int32
    slot_mapping: Tensor  # [num_tokens] int64
    dense_k: list[Tensor]  # per sequence [ctx, num_kv_heads, head_size]
    dense_v: list[Tensor]  # per sequence [ctx, num_kv_heads, head_size]


def make_batch(
    specs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> Batch:
    """Build a batch from (cached_prefix_len, q_len) specs: prefixes pre-written, new tokens left to write."""
    gen = torch.Generator().manual_seed(seed)
    ctxs = [prefix + q_len for prefix, q_len in specs]
    blocks_per_seq = [-(-ctx // block_size) for ctx in ctxs]
    num_blocks = sum(blocks_per_seq) + 3
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq) + 1  # always at least one -1 column
    rows: list[list[int]] = []
    for n in blocks_per_seq:
        rows.append(physical[:n] + [-1] * (width - n))
        physical = physical[n:]

    # NaN everywhere not written: any read outside a sequence's context poisons the result.
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    k_flat, v_flat = k_cache.view(-1, num_kv_heads, head_size), v_cache.view(-1, num_kv_heads, head_size)

    dense_k, dense_v, new_k, new_v, slots = [], [], [], [], []
    for (prefix, _), ctx, row in zip(specs, ctxs, rows, strict=True):
        k = torch.randn(ctx, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_size, generator=gen).to(dtype)
        dense_k.append(k)
        dense_v.append(v)
        for pos in range(prefix):
            k_flat[slot_of(row, pos, block_size)] = k[pos]
            v_flat[slot_of(row, pos, block_size)] = v[pos]
        new_k.append(k[prefix:])
        new_v.append(v[prefix:])
        slots += [slot_of(row, pos, block_size) for pos in range(prefix, ctx)]

    q_lens = [q_len for _, q_len in specs]
    num_tokens = sum(q_lens)
    return Batch(
        query=torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype),
        key=torch.cat(new_k),
        value=torch.cat(new_v),
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=torch.tensor(rows, dtype=torch.int32),
        seq_lens=torch.tensor(ctxs, dtype=torch.int32),
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        dense_k=dense_k,
        dense_v=dense_v,
    )


def mixed_specs(block_size: int, seed: int) -> list[tuple[int, int]]:
    """Decodes and prefill chunks (with and without a cached prefix) around block boundaries, shuffled."""
    bs = block_size
    decodes = [(ctx - 1, 1) for ctx in (1, bs - 1, bs, bs + 1, 3 * bs + 5)]
    fresh_prefills = [(0, 5), (0, bs), (0, bs + 1)]
    chunked_prefills = [(1, 2), (bs - 1, bs + 2), (2 * bs, 3), (bs, bs)]
    specs = decodes + fresh_prefills + chunked_prefills
    random.Random(seed).shuffle(specs)
    return specs
