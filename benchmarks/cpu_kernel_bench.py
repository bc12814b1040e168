"""The CPU hot spots against what they replace, in the same run: decode attention and the LM head.

    .venv/bin/python benchmarks/cpu_kernel_bench.py                 # the grid in the README
    .venv/bin/python benchmarks/cpu_kernel_bench.py --batches 8 --contexts 256 --layers 4
    .venv/bin/python benchmarks/cpu_kernel_bench.py --pool-gib 1 --dtype bfloat16   # the engine's pool
    .venv/bin/python benchmarks/cpu_kernel_bench.py --batches 1 --contexts 128 --head-rows 1 \
        --prefill-lengths 32 128 512 768 1024 2048                   # prefill attention too

Decode attention at SmolLM2's shape (9 query heads over 3 KV heads, head size 64, block size 16, fp32 or
--dtype), every sequence's blocks shuffled through the pool: the C++ kernel (torch.ops.pagedserve_cpu) against
its pure-torch twin (gather the context, then SDPA). Each timed call goes through --layers pools in turn, as a
forward pass reads every layer's K/V once, so caches are cold as in a model; the time is per layer, best of
--repeats. By default each layer's pool holds just the batch's blocks; --pool-gib G takes them instead at
random from the engine's own pool (KVCache, in transparent huge pages where Linux grants them) of G GiB over
all layers, as a serving engine's blocks lie. --adjacent-blocks lays each sequence's blocks side by side
instead, which prices the jumps between scattered blocks. GB/s: the K and V rows' bytes over the kernel's
time.
With --prefill-lengths, prefill attention too: chunks of each length (after --prefill-prefix cached tokens),
as many as make --prefill-tokens, every token through the C++ kernel
(torch.ops.pagedserve_cpu.paged_attention) against the twin's SDPA over each chunk's gathered context.
The LM head ([vocab, hidden] = [49152, 576]): F.linear against PackedLinear (oneDNN, weight packed once) for a
few row counts.
Prints the tables; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from gpu_worker.engine.kv_cache import KVCache
from gpu_worker.engine.packed_linear import PackedLinear
from kernels import reference

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 9, 3, 64, 16
VOCAB, HIDDEN = 49152, 576


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def pools(
    num_blocks: int, layers: int, pool_gib: float, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V): num_blocks of random rows, or the engine's pool of pool_gib GiB (random rows)."""
    if not pool_gib:
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
        return [(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)) for _ in range(layers)]
    per_block = KVCache.bytes_per_block(layers, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype)
    pool_blocks = int(pool_gib * 2**30) // per_block
    assert pool_blocks >= num_blocks, f"a pool of {pool_gib} GiB holds {pool_blocks} blocks, not {num_blocks}"
    cache = KVCache(layers, pool_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype, torch.device("cpu"))
    cache.kv_cache.normal_()
    return cache.layers


def kernel_against_twin(
    kernel: Callable[[torch.Tensor, torch.Tensor], object],
    twin: Callable[[torch.Tensor, torch.Tensor], object],
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    outs: tuple[torch.Tensor, torch.Tensor],
    repeats: int,
) -> tuple[float, float]:
    """Per layer, the best ms of kernel(K, V) and of twin(K, V) through every layer's pools in turn; the two
    outputs they wrote (outs) must agree."""
    layers = len(caches)
    kernel_ms = best_ms(lambda: [kernel(k, v) for k, v in caches], repeats) / layers
    twin_ms = best_ms(lambda: [twin(k, v) for k, v in caches], repeats) / layers
    tolerance = 1e-5 if outs[0].dtype == torch.float32 else 2e-2
    torch.testing.assert_close(*outs, atol=tolerance, rtol=tolerance)
    return kernel_ms, twin_ms


def attention_case(
    batch: int,
    context: int,
    layers: int,
    repeats: int,
    pool_gib: float,
    dtype: torch.dtype,
    adjacent: bool = False,
) -> dict[str, Any]:
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    caches = pools(num_blocks, layers, pool_gib, dtype)
    pool_blocks = caches[0][0].shape[0]
    if adjacent:  # each sequence's blocks side by side, the batch's from a random place in the pool
        start = int(torch.randint(pool_blocks - num_blocks + 1, ()))
        chosen = torch.arange(start, start + num_blocks, dtype=torch.int32)
    else:  # the batch's blocks, anywhere in the pool
        chosen = torch.randperm(pool_blocks, dtype=torch.int32)[:num_blocks]
    block_table = chosen.view(batch, blocks_per_seq).contiguous()
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32)
    query = torch.randn(batch, NUM_HEADS, HEAD_SIZE, dtype=dtype)
    out_kernel, out_twin = torch.empty_like(query), torch.empty_like(query)
    meta = (block_table, seq_lens, query_start_loc, HEAD_SIZE**-0.5)
    kernel_ms, twin_ms = kernel_against_twin(
        lambda k, v: kernels.paged_attention(out_kernel, query, k, v, *meta),
        lambda k, v: reference.paged_attention(out_twin, query, k, v, *meta),
        caches,
        (out_kernel, out_twin),
        repeats,
    )
    rows_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_SIZE * dtype.itemsize  # K and V, read once
    return {"batch": batch, "context": context, "kernel_ms": kernel_ms, "twin_ms": twin_ms,
            "speedup": twin_ms / kernel_ms, "kernel_gb_s": rows_bytes / kernel_ms / 1e6}  # fmt: skip


def prefill_case(
    length: int, prefix: int, tokens: int, layers: int, repeats: int, pool_gib: float, dtype: torch.dtype
) -> dict[str, Any]:
    """Prefill chunks of `length` new tokens after `prefix` cached ones, as many as make `tokens` (at least
    one): the C++ kernel taking every token of them against the twin (SDPA over each chunk's gathered
    context)."""
    seqs = max(1, tokens // length)
    blocks_per_seq = -(-(prefix + length) // BLOCK_SIZE)
    caches = pools(seqs * blocks_per_seq, layers, pool_gib, dtype)
    chosen = torch.randperm(caches[0][0].shape[0], dtype=torch.int32)[: seqs * blocks_per_seq]
    block_table = chosen.view(seqs, blocks_per_seq).contiguous()
    seq_lens = torch.full((seqs,), prefix + length, dtype=torch.int32)
    query_start_loc = torch.arange(0, seqs * length + 1, length, dtype=torch.int32)
    query = torch.randn(seqs * length, NUM_HEADS, HEAD_SIZE, dtype=dtype)
    out_kernel, out_twin = torch.empty_like(query), torch.empty_like(query)
    meta = (block_table, seq_lens, query_start_loc, HEAD_SIZE**-0.5)

    def kernel(k: torch.Tensor, v: torch.Tensor) -> None:
        taken = torch.ops.pagedserve_cpu.paged_attention(out_kernel, query, k, v, *meta, length)
        assert taken == length, "the kernel takes prefill chunks in its AVX-512 loops only"

    kernel_ms, twin_ms = kernel_against_twin(
        kernel,
        lambda k, v: reference.prefill_attention(out_twin, query, k, v, *meta),
        caches,
        (out_kernel, out_twin),
        repeats,
    )
    return {"length": length, "prefix": prefix, "sequences": seqs, "kernel_ms": kernel_ms, "twin_ms": twin_ms,
            "speedup": twin_ms / kernel_ms}  # fmt: skip


def lm_head_case(rows: int, repeats: int, weight: torch.Tensor) -> dict[str, Any]:
    x = torch.randn(1, rows, weight.shape[1])
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    head = PackedLinear(linear)
    linear_ms = best_ms(lambda: F.linear(x, weight), repeats)
    packed_ms = best_ms(lambda: head(x), repeats)
    return {"rows": rows, "linear_ms": linear_ms, "packed_ms": packed_ms,
            "speedup": linear_ms / packed_ms}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--layers", type=int, default=30, help="pools gone through per timed call")
    parser.add_argument("--head-rows", type=int, nargs="+", default=[1, 2, 8, 32, 64])
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="K, V, queries")
    parser.add_argument("--pool-gib", type=float, default=0, help="blocks from the engine's pool, this big")
    parser.add_argument(
        "--adjacent-blocks",
        action="store_true",
        help="each decode sequence's blocks side by side in the pool, not scattered: what the jumps cost",
    )
    parser.add_argument(
        "--prefill-lengths",
        type=int,
        nargs="*",
        default=[],
        help="also prefill attention: chunks of these many new tokens, each as many as make --prefill-tokens",
    )
    parser.add_argument("--prefill-prefix", type=int, default=0, help="cached tokens before each chunk")
    parser.add_argument("--prefill-tokens", type=int, default=2048, help="new tokens a prefill call takes")
    parser.add_argument("--json", default="benchmarks/results/cpu_kernel_bench.json")
    args = parser.parse_args(argv)
    with torch.inference_mode():
        dtype = getattr(torch, args.dtype)
        assert kernels.load(torch.device("cpu"), dtype), "the CPU kernel did not build; see the log"
        common = (args.layers, args.repeats, args.pool_gib, dtype)
        attention = [
            attention_case(b, c, *common, adjacent=args.adjacent_blocks)
            for b in args.batches
            for c in args.contexts
        ]
        prefill = [
            prefill_case(n, args.prefill_prefix, args.prefill_tokens, *common) for n in args.prefill_lengths
        ]
        weight = torch.randn(args.vocab, HIDDEN)
        lm_head = [lm_head_case(r, args.repeats, weight) for r in args.head_rows]
    pool = f"blocks from a {args.pool_gib:g} GiB pool" if args.pool_gib else "pools of the batch's blocks"
    order = "each sequence's side by side" if args.adjacent_blocks else "scattered"
    print(f"decode attention per layer, {args.dtype}, {pool} ({order}), {torch.get_num_threads()} threads, "
          "cold caches")  # fmt: skip
    print(f"{'batch':>5} {'context':>7} {'kernel ms':>10} {'GB/s':>6} {'twin ms':>8} {'speedup':>8}")
    for r in attention:
        row = f"{r['batch']:5d} {r['context']:7d} {r['kernel_ms']:10.3f} {r['kernel_gb_s']:6.1f}"
        print(f"{row} {r['twin_ms']:8.3f} {r['speedup']:7.1f}x")
    if prefill:
        print(f"prefill attention per layer, {args.prefill_prefix} cached tokens before each chunk")
        print(f"{'chunk':>6} {'chunks':>6} {'kernel ms':>10} {'twin ms':>8} {'speedup':>8}")
        for r in prefill:
            row = f"{r['length']:6d} {r['sequences']:6d} {r['kernel_ms']:10.3f} {r['twin_ms']:8.3f}"
            print(f"{row} {r['speedup']:7.2f}x")
    print(f"LM head [{args.vocab}, {HIDDEN}]")
    print(f"{'rows':>5} {'F.linear ms':>12} {'packed ms':>11} {'speedup':>8}")
    for r in lm_head:
        print(f"{r['rows']:5d} {r['linear_ms']:12.2f} {r['packed_ms']:11.2f} {r['speedup']:7.1f}x")
    results = {
        "args": vars(args),
        "threads": torch.get_num_threads(),
        "attention": attention,
        "prefill": prefill,
        "lm_head": lm_head,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
