"""Paged-attention decode kernel against the memory-bandwidth limit and against SDPA, in the same run.

One query token per sequence, bf16, 32 query heads over 8 KV heads (GQA 4, as in Llama-3-8B), block size 16,
every sequence's blocks shuffled through the pool. For each head size, batch B and context L it reports:
- the kernel's time (CUDA events, warm-up, median of repeats) and its effective bandwidth, the bytes of K and
  V it must read over that time, next to a device-to-device copy measured in the same run;
- torch's scaled_dot_product_attention (enable_gqa) on the same K/V laid out contiguously, and the ratio;
- at B=1, the split-K kernel against the single-pass one.
L2 is flushed before every timed call, as a forward pass reads each layer's K/V once. Prints a table and
writes JSON.

    python benchmarks/kernel_bench.py                       # the full grid
    python benchmarks/kernel_bench.py --batches 1 8 --contexts 512 4096 --head-sizes 128
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels.build import load_extension

NUM_HEADS, NUM_KV_HEADS, BLOCK_SIZE, DTYPE = 32, 8, 16, torch.bfloat16
DEFAULT_JSON = Path(__file__).parent / "results" / "kernel_bench.json"


# (title, width, (result key, format)); microseconds are the milliseconds times 1000.
COLUMNS = [
    ("D", 4, ("head_size", "d")),
    ("B", 4, ("batch", "d")),
    ("L", 6, ("context", "d")),
    ("kernel us", 10, ("kernel_ms", "us")),
    ("GB/s", 7, ("kernel_gbps", ".0f")),
    ("of copy", 8, ("fraction_of_copy", ".0%")),
    ("SDPA us", 9, ("sdpa_ms", "us")),
    ("vs SDPA", 8, ("kernel_over_sdpa", "x")),
    ("unsplit us", 11, ("unsplit_ms", "us")),
    ("split us", 9, ("split_ms", "us")),
    ("speedup", 8, ("split_speedup", "x")),
]


def cell(result: dict[str, Any], key: str, width: int, fmt: str) -> str:
    value = result.get(key)
    if value is None:
        text = "-"
    elif fmt == "us":
        text = f"{value * 1e3:.1f}"
    elif fmt == "x":
        text = f"{value:.2f}x"
    else:
        text = format(value, fmt)
    return f"{text:>{width}}"


def time_ms(fn: Callable[[], object], repeats: int = 20, flush: torch.Tensor | None = None) -> float:
    """Median milliseconds of one call after a warm-up. With flush, that buffer is overwritten before each
    call so the call's inputs come from memory, not L2: in a forward pass each layer's K/V is read once."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        if flush is not None:
            flush.zero_()
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return sorted(samples)[len(samples) // 2]


def copy_bandwidth(gib: float = 4.0) -> float:
    """GB/s of a device-to-device copy, counting the bytes read and the bytes written."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), repeats=10)
    return 2 * src.numel() / ms / 1e6


def run_case(
    ops: Any, head_size: int, batch: int, context: int, copy_gbps: float, flush: torch.Tensor
) -> dict[str, Any]:
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_size)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    block_table = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, NUM_HEADS, head_size, dtype=DTYPE, device="cuda")
    out = torch.empty_like(query)
    scale = head_size**-0.5

    def paged(split: int) -> Callable[[], object]:
        args = (out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, split)
        return lambda: ops.paged_attention_decode(*args)

    # The same K/V gathered into [batch, num_kv_heads, context, head_size] for SDPA.
    def dense(cache: torch.Tensor) -> torch.Tensor:
        rows = cache[block_table.long()].view(batch, blocks_per_seq * BLOCK_SIZE, NUM_KV_HEADS, head_size)
        return rows[:, :context].transpose(1, 2).contiguous()

    k, v = dense(k_cache), dense(v_cache)
    q = query.unsqueeze(2)  # [batch, num_heads, 1, head_size]

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    kv_bytes = 2 * batch * context * NUM_KV_HEADS * head_size * DTYPE.itemsize
    result: dict[str, Any] = dict(head_size=head_size, batch=batch, context=context, kv_bytes=kv_bytes)
    result["kernel_ms"] = time_ms(paged(-1), flush=flush)
    result["kernel_gbps"] = kv_bytes / result["kernel_ms"] / 1e6
    result["fraction_of_copy"] = result["kernel_gbps"] / copy_gbps
    try:
        result["max_abs_diff_vs_sdpa"] = float((out.float() - sdpa().squeeze(2).float()).abs().max())
        result["sdpa_ms"] = time_ms(sdpa, flush=flush)
        result["kernel_over_sdpa"] = result["kernel_ms"] / result["sdpa_ms"]
    except torch.cuda.OutOfMemoryError:  # an SDPA backend that repeats K/V for every query head
        result["sdpa_ms"] = None
    if batch == 1:
        result["unsplit_ms"] = time_ms(paged(0), flush=flush)
        result["split_ms"] = time_ms(paged(1), flush=flush)
        result["split_speedup"] = result["unsplit_ms"] / result["split_ms"]
    return result


def fits(head_size: int, batch: int, context: int) -> bool:
    """The paged K/V plus its contiguous copy for SDPA, with room to spare."""
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * head_size * DTYPE.itemsize
    free, _ = torch.cuda.mem_get_info()
    return 2 * kv_bytes < 0.7 * free


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    parser.add_argument("--head-sizes", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"default {DEFAULT_JSON}")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_bench: needs a CUDA device; this machine has none", file=sys.stderr)
        return 1
    ops = load_extension()
    if ops is None:
        print("kernel_bench: the CUDA kernels could not be built (see the log above)", file=sys.stderr)
        return 1

    copy_gbps = copy_bandwidth()
    torch.cuda.empty_cache()
    # Four times the L2 of an H100/H200 (50-60 MB).
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_gbps:.0f} GB/s (read + write)")
    print(" ".join(f"{title:>{width}}" for title, width, _ in COLUMNS))
    results = []
    for head_size in args.head_sizes:
        for batch in args.batches:
            for context in args.contexts:
                if not fits(head_size, batch, context):
                    print(f"{head_size:>4} {batch:>4} {context:>6}  skipped: does not fit in memory")
                    continue
                r = run_case(ops, head_size, batch, context, copy_gbps, flush)
                results.append(r)
                print(" ".join(cell(r, key, width, fmt) for _, width, (key, fmt) in COLUMNS), flush=True)
                torch.cuda.empty_cache()

    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "dtype": str(DTYPE),
        "num_heads": NUM_HEADS,
        "num_kv_heads": NUM_KV_HEADS,
        "block_size": BLOCK_SIZE,
        "copy_gbps": copy_gbps,
        "l2_flushed": True,
        "results": results,
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
