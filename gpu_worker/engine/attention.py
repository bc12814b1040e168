"""Paged attention plugged into transformers' attention interface.

The model runner passes one `AttentionMetadata` per step as the `paged_metadata` forward kwarg; transformers
hands it to every attention layer, which writes the step's new K/V into their slots and attends through the
block tables. Queries arrive as one flat batch `[1, num_heads, num_tokens, head_size]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface

import kernels

ATTENTION_NAME = "pagedserve"


@dataclass(slots=True)
class AttentionMetadata:
    """Everything the attention layers need for one step, built once by the model runner."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V): [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_table: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int32, -1 padded
    seq_lens: torch.Tensor  # [num_seqs] int32, context after this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, num_heads, num_tokens, head_size]
    key: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_size]
    value: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_size]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_metadata: AttentionMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the paged KV pool; returns `[1, num_tokens, num_heads, head_size]`."""
    meta = paged_metadata
    assert meta is not None, "the pagedserve attention runs only inside the model runner"
    k_cache, v_cache = meta.kv_caches[module.layer_idx]  # type: ignore[index]
    q = query[0].transpose(0, 1)
    kernels.write_kv_cache(
        key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, meta.slot_mapping
    )
    out = torch.empty_like(q)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    kernels.paged_attention(
        out, q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.query_start_loc, scale
    )
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
