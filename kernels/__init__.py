"""Paged KV-cache ops: the single import point the model runner uses.

Each op runs its CUDA kernel (kernels/csrc, built on first use) when its tensors are on a CUDA device, and its
pure-torch twin from kernels.reference otherwise or where no kernel is compiled for the shape; both share one
signature. On the CPU, decode attention and the elementwise ops of a Llama-family layer (norms, SiLU-and-mul,
rotary written into the cache) in float32 and bfloat16 run C++ kernels (kernels/csrc/cpu, also built on first
use) when a compiler is at hand. Callers never import reference or the extensions directly.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from kernels import reference

__all__ = [
    "add_rms_norm",
    "amx",
    "amx_ready",
    "avx512",
    "avx512_bf16_tiles",
    "copy_blocks",
    "cpp_layers_support",
    "first_max_ids",
    "llama_decode_layers",
    "load",
    "packed_linear",
    "paged_attention",
    "panel_kernel_ready",
    "rms_norm",
    "rotary_write_kv",
    "silu_and_mul",
    "write_kv_cache",
]

# Kept equal to PAGEDSERVE_FOR_EACH_HEAD_SIZE in csrc/paged_attention.h (a test compares them).
DECODE_HEAD_SIZES = (64, 80, 96, 112, 128, 256)
DECODE_BLOCK_SIZES = (8, 16, 32)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CPU_DTYPES = (torch.float32, torch.bfloat16)
# The CPU kernel's head size: a multiple of its vector width (kLanes in csrc/cpu/paged_attention_cpu.cpp).
CPU_HEAD_SIZE_MULTIPLE = 8
# On the CPU, prefill chunks of up to this many tokens go through the C++ kernel's AVX-512 passes too, each
# token attending as a decode over its context up to itself (four tokens to a pass over K and V): against SDPA
# over the gathered context, 6.9x (bf16) and 4.2x (fp32) as fast in chunks of 32, 2.1x and 1.5x at 512, 1.5x
# and 1.1x at 1024; at 2048 fp32's SDPA is ahead (0.92x), where its blocked matmuls catch up
# (benchmarks/cpu_kernel_bench.py --prefill-lengths ..., docs/kernels.md). Its AVX2 passes take chunks of up
# to 128 tokens (kAvx2PrefillTokens in kernels/csrc/cpu/paged_attention_cpu.cpp).
CPU_PREFILL_KERNEL_TOKENS = 1024


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
    cpu_ops = _cpu_ops(k_cache) if query.device.type == "cpu" else None
    if cpu_ops is not None:
        # The CPU kernel takes the decodes and the prefill chunks up to CPU_PREFILL_KERNEL_TOKENS tokens (the
        # decodes alone where it was built without AVX2), and says up to how many it took.
        longest = int(cpu_ops.paged_attention(*args, CPU_PREFILL_KERNEL_TOKENS))
    else:
        # The kernel takes the decodes and skips every sequence with more than one query token.
        longest = 1
        decode(*args)
    # With one token per sequence there are no prefill chunks: known from shapes, without reading the device.
    if query.shape[0] != seq_lens.shape[0]:
        reference.prefill_attention(*args, longer_than=longest)


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


def _cpu_rows(*tensors: Tensor) -> Any | None:
    """The CPU ops for these tensors, where each is contiguous in its last dimension; else None."""
    ops = _cpu_ops(tensors[0])
    return ops if ops is not None and all(t.stride(-1) == 1 for t in tensors) else None


def rms_norm(out: Tensor, x: Tensor, weight: Tensor, eps: float) -> None:
    """out = weight * x / rms(x) over the last dimension, as transformers' RMSNorm rounds it."""
    ops = _cpu_rows(x, out, weight)
    if ops is None or not (x.is_contiguous() and out.is_contiguous()):
        reference.rms_norm(out, x, weight, eps)
        return
    ops.rms_norm(out, x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """residual += x, then x = weight * residual / rms(residual): a layer's residual sum and the next norm."""
    ops = _cpu_rows(x, residual, weight)
    if ops is None or not (x.is_contiguous() and residual.is_contiguous()):
        reference.add_rms_norm(x, residual, weight, eps)
        return
    ops.add_rms_norm(x, residual, weight, eps)


def silu_and_mul(out: Tensor, gate_up: Tensor) -> None:
    """out = silu(gate) * up, where each row of gate_up is [gate | up] (one matmul's output)."""
    ops = _cpu_rows(gate_up, out)
    if ops is None:
        reference.silu_and_mul(out, gate_up)
        return
    ops.silu_and_mul(out, gate_up)


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
    """Rotary position embedding of the query (in place) and of the key as it is written into its cache slot,
    with the value beside it; a token whose slot is -1 is rotated and not written."""
    ops = _cpu_rows(query, key, value, cos, sin, k_cache, v_cache)
    if ops is None:
        reference.rotary_write_kv(query, key, value, cos, sin, k_cache, v_cache, slot_mapping)
        return
    ops.rotary_write_kv(query, key, value, cos, sin, k_cache, v_cache, slot_mapping.long())


def first_max_ids(logits: Tensor) -> Tensor:
    """Each row's index of its first largest value (its first NaN, if it has one), as argmax gives it, of
    logits [rows, vocab] in their own dtype: greedy decoding's pick, without a float32 copy of the logits."""
    ops = _cpu_rows(logits)
    if ops is None or logits.dim() != 2 or logits.shape[1] == 0:
        return reference.first_max_ids(logits)
    return ops.first_max_ids(logits)


def cpp_layers_support(weight: Tensor, head_size: int) -> bool:
    """Whether llama_decode_layers runs a model of these weights (on the CPU, in float32 or bfloat16, with the
    kernels built) and this head size (the decode-attention kernel's)."""
    return _cpu_ops(weight) is not None and head_size % CPU_HEAD_SIZE_MULTIPLE == 0


def llama_decode_layers(
    hidden: Tensor,  # [num_tokens, hidden_size], the step's embeddings
    weights: list[Tensor | None],  # per layer: qkv, its bias, o, gate_up, down, the two norms, q and k norms
    final_norm: Tensor,
    cos: Tensor,  # [num_tokens, head_size]
    sin: Tensor,
    meta: Any,  # gpu_worker.engine.attention.AttentionMetadata, every sequence with one query token
    shape: tuple[int, int, int],  # num_heads, num_kv_heads, head_size
    eps: float,
    scale: float,
    panels: list[int] | None = None,  # per layer: qkv's, o's, gate_up's, down's panel width (packed_linear)
) -> Tensor:
    """Every layer of a decode step in one C++ call (weights packed for oneDNN); the last hidden state, summed
    and normed by final_norm. Only where cpp_layers_support says so."""
    ops = _cpu_ops(hidden)
    assert ops is not None
    k_caches = [k for k, _ in meta.kv_caches]
    v_caches = [v for _, v in meta.kv_caches]
    return ops.llama_decode_layers(
        hidden, weights, final_norm, cos, sin, k_caches, v_caches, meta.slot_mapping, meta.block_table,
        meta.seq_lens, meta.query_start_loc, *shape, eps, scale, panels or [],
    )  # fmt: skip


def panel_kernel_ready(dtype: torch.dtype = torch.float32) -> bool:
    """Whether packed_linear can multiply `dtype` rows through the panel kernel: float32 where the CPU
    extension is built with AVX2 and FMA or the CPU has AVX-512 (elsewhere the kernel is a plain loop, slower
    than oneDNN), bfloat16 there too (by AVX512_BF16 where the CPU has it, else with the weights widened to
    float32); and PAGEDSERVE_PANEL_KERNEL is not 0."""
    if os.environ.get("PAGEDSERVE_PANEL_KERNEL", "1") == "0":
        return False
    ops = _cpu_ops(torch.empty(0))
    if ops is None:
        return False
    if dtype == torch.float32:
        return bool(ops.panel_linear_vectorized())
    return dtype == torch.bfloat16 and bool(ops.panel_linear_bf16())


@contextlib.contextmanager
def _switched(setter: str, enabled: bool) -> Iterator[None]:
    """A run-time switch of the CPU kernels (the op `setter` returns the old state) set within the block."""
    ops = _cpu_ops(torch.empty(0))
    assert ops is not None, "no CPU kernels here"
    was = getattr(ops, setter)(enabled)
    try:
        yield
    finally:
        getattr(ops, setter)(was)


def avx512(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """The CPU kernels' AVX-512 loops turned on (where the CPU has them) or off within the block; off, they
    run their AVX2 loops. Outside, PAGEDSERVE_AVX512=0 in the environment turns them off for the process."""
    return _switched("set_avx512", enabled)


def amx(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """The bfloat16 panel kernel's AMX tiles turned on (where the CPU has AMX-BF16) or off within the block;
    off, it runs its AVX512_BF16 tiles. Outside, PAGEDSERVE_AMX=0 turns them off for the process."""
    return _switched("set_amx", enabled)


def avx512_bf16_tiles(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """The bfloat16 panel kernel's AVX512_BF16 and AMX tiles turned on (where the CPU has them) or off within
    the block; off, it widens the weights to float32 as on CPUs without them."""
    return _switched("set_avx512_bf16_tiles", enabled)


def amx_ready() -> bool:
    """Whether the bfloat16 panel kernel can run on AMX tiles here (the CPU has AMX-BF16, Linux grants it)."""
    ops = _cpu_ops(torch.empty(0))
    return ops is not None and bool(ops.amx_bf16_ready())


def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None, panel: int) -> Tensor:
    """x [..., K] times a weight packed for oneDNN, whose bytes are `panel`-column panels (gpu_worker/engine/
    packed_linear.py checks): through the panel kernel for up to 128 rows (a decode step), oneDNN beyond; or
    times a bfloat16 weight packed as panels of pairs without oneDNN ([N / panel, K / 2, panel, 2], on CPUs
    where oneDNN only emulates bfloat16): through the panel kernel for any rows. Only where panel_kernel_ready
    says so for x's dtype."""
    ops = _cpu_ops(x)
    assert ops is not None
    return ops.packed_linear(x, weight, bias, panel)
