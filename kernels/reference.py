"""Pure-torch reference implementations of the paged KV-cache ops (CPU, or any device torch supports)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def write_kv_cache(
    key: Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: Tensor,  # [num_tokens, num_kv_heads, head_size]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Write each token's K/V into its cache slot, skipping tokens whose slot is -1."""
    if slot_mapping.numel() == 0:
        return
    # view (not reshape) so a non-contiguous cache fails loudly instead of writing into a copy.
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    slots = slot_mapping.long()
    if int(slots.min()) >= 0:
        k_flat.index_copy_(0, slots, key)
        v_flat.index_copy_(0, slots, value)
        return
    keep = slots >= 0
    slots = slots[keep]
    k_flat.index_copy_(0, slots, key[keep])
    v_flat.index_copy_(0, slots, value[keep])


def _gather_context(
    cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_rows: Tensor,  # [n, max_num_blocks_per_seq] int32, -1 padded
    ctx_lens: Tensor,  # [n] int32
    length: int,
) -> Tensor:
    """Gather positions 0..length-1 of each row's context into [n, num_kv_heads, length, head_size]."""
    block_size, num_kv_heads, head_size = cache.shape[1:]
    # Positions past a sequence's end re-read its last token instead of the slot behind it: those slots may
    # hold never-written memory, and a NaN there leaks through the masked softmax (0 * NaN). This also keeps
    # -1 block-table padding from ever being dereferenced, and is cheaper than zeroing the padding afterwards.
    pos = torch.arange(length, device=cache.device)
    pos = torch.minimum(pos[None, :], ctx_lens.long()[:, None] - 1)  # [n, length]
    slots = block_rows.long().gather(1, pos // block_size) * block_size + pos % block_size
    flat = cache.view(-1, num_kv_heads, head_size)
    gathered = flat.index_select(0, slots.view(-1)).view(len(slots), length, num_kv_heads, head_size)
    return gathered.transpose(1, 2)


def paged_attention(
    out: Tensor,  # [num_tokens, num_heads, head_size]
    query: Tensor,  # [num_tokens, num_heads, head_size]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table: Tensor,  # [num_seqs, max_num_blocks_per_seq] int32, -1 padded
    seq_lens: Tensor,  # [num_seqs] int32, cached context + this step's tokens
    query_start_loc: Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    scale: float,
) -> None:
    """Causal attention of each sequence's new query tokens over its whole paged context, written into out."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    num_seqs = len(lens)
    decodes = [s for s in range(num_seqs) if starts[s + 1] - starts[s] == 1]
    prefills = [s for s in range(num_seqs) if starts[s + 1] - starts[s] > 1]

    if decodes:
        _decode_batch(out, query, k_cache, v_cache, block_table, seq_lens, starts, lens, decodes, scale)
    _prefill_each(out, query, k_cache, v_cache, block_table, seq_lens, starts, lens, prefills, scale)


def prefill_attention(
    out: Tensor,  # [num_tokens, num_heads, head_size]
    query: Tensor,  # [num_tokens, num_heads, head_size]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table: Tensor,  # [num_seqs, max_num_blocks_per_seq] int32, -1 padded
    seq_lens: Tensor,  # [num_seqs] int32, cached context + this step's tokens
    query_start_loc: Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    scale: float,
    longer_than: int = 1,
) -> None:
    """paged_attention of the sequences with more than longer_than new tokens; the other rows of out are
    untouched."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    prefills = [s for s in range(len(lens)) if starts[s + 1] - starts[s] > longer_than]
    _prefill_each(out, query, k_cache, v_cache, block_table, seq_lens, starts, lens, prefills, scale)


def _prefill_each(
    out: Tensor,  # [num_tokens, num_heads, head_size]
    query: Tensor,  # [num_tokens, num_heads, head_size]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table: Tensor,  # [num_seqs, max_num_blocks_per_seq] int32, -1 padded
    seq_lens: Tensor,  # [num_seqs] int32
    starts: list[int],
    lens: list[int],
    prefills: list[int],
    scale: float,
) -> None:
    """One SDPA call per prefill chunk over its gathered context, causal from its first new token on."""
    for s in prefills:
        q_start, q_end, ctx = starts[s], starts[s + 1], lens[s]
        rows, ctx_lens = block_table[s : s + 1], seq_lens[s : s + 1]
        k = _gather_context(k_cache, rows, ctx_lens, ctx)  # [1, Hkv, ctx, D]
        v = _gather_context(v_cache, rows, ctx_lens, ctx)
        q = query[q_start:q_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        prefix = ctx - (q_end - q_start)
        if prefix == 0:
            res = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # is_causal aligns the diagonal top-left; with a cached prefix it must sit at key `prefix`.
            q_pos = torch.arange(prefix, ctx, device=query.device)
            mask = torch.arange(ctx, device=query.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
            res = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[q_start:q_end] = res[0].transpose(0, 1)


def _decode_batch(
    out: Tensor,  # [num_tokens, num_heads, head_size]
    query: Tensor,  # [num_tokens, num_heads, head_size]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table: Tensor,  # [num_seqs, max_num_blocks_per_seq] int32, -1 padded
    seq_lens: Tensor,  # [num_seqs] int32
    starts: list[int],
    lens: list[int],
    decodes: list[int],
    scale: float,
) -> None:
    """All single-token sequences in one SDPA call over contexts padded to the longest among them."""
    device = query.device
    toks: slice | Tensor
    if len(decodes) == len(lens):
        rows, ctx_lens, toks = block_table, seq_lens, slice(None)
    else:
        seq_idx = torch.tensor(decodes, device=device)
        rows, ctx_lens = block_table[seq_idx], seq_lens[seq_idx]
        toks = torch.tensor([starts[s] for s in decodes], device=device)
    length = max(lens[s] for s in decodes)
    k = _gather_context(k_cache, rows, ctx_lens, length)  # [n, Hkv, L, D]
    v = _gather_context(v_cache, rows, ctx_lens, length)
    valid = torch.arange(length, device=device)[None, :] < ctx_lens[:, None]  # [n, L]
    q = query[toks].unsqueeze(2)  # [n, Hq, 1, D]
    res = F.scaled_dot_product_attention(
        q, k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
    )
    out[toks] = res.squeeze(2)


def copy_blocks(
    kv_cache: Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]
    block_mapping: Tensor,  # [num_pairs, 2] int64 of (src, dst)
) -> None:
    """Copy block src to block dst for K and V in every layer (copy-on-write)."""
    if block_mapping.numel() == 0:
        return
    mapping = block_mapping.to(device=kv_cache.device, dtype=torch.long)
    # index_select gathers every source before any write, so chained pairs (a->b, b->c) read pre-copy data.
    kv_cache.index_copy_(2, mapping[:, 1], kv_cache.index_select(2, mapping[:, 0]))


# The elementwise ops of a Llama-family layer, written as transformers' Llama modules compute them.


def rms_norm(out: Tensor, x: Tensor, weight: Tensor, eps: float) -> None:
    """out = weight * x / rms(x) over the last dimension (the statistics in float32)."""
    row = x.float()
    normed = row * torch.rsqrt(row.pow(2).mean(-1, keepdim=True) + eps)
    out.copy_(weight * normed.to(x.dtype))


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """residual += x, then x = weight * residual / rms(residual)."""
    residual.copy_(residual + x)
    rms_norm(x, residual, weight, eps)


def silu_and_mul(out: Tensor, gate_up: Tensor) -> None:
    """out = silu(gate) * up, where each row of gate_up is [gate | up]."""
    gate, up = gate_up.chunk(2, dim=-1)
    out.copy_(F.silu(gate) * up)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin over each head of x [tokens, heads, head_size], with cos and sin
    [tokens, head_size]."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + turned * sin.unsqueeze(1)


def rotary_write_kv(
    query: Tensor,  # [num_tokens, num_heads, head_size], rotated in place
    key: Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: Tensor,  # [num_tokens, num_kv_heads, head_size]
    cos: Tensor,  # [num_tokens, head_size]
    sin: Tensor,  # [num_tokens, head_size]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Rotary position embedding of the query (in place) and of the key as it is written into the cache."""
    query.copy_(rotate(query, cos, sin))
    write_kv_cache(rotate(key, cos, sin), value, k_cache, v_cache, slot_mapping)


def first_max_ids(logits: Tensor) -> Tensor:
    """Each row's index of its first largest value (its first NaN, if it has one), as argmax gives it;
    torch.max's reduction finds it faster on the CPU."""
    return logits.max(dim=-1).indices
