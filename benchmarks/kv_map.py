"""What the dashboard's block map costs a worker: the size of the encoded map (shared.kv_map) and the time to
build and encode it from a real block allocator, at a pool of --blocks blocks.

    .venv/bin/python benchmarks/kv_map.py                  # 100,000 blocks
    .venv/bin/python benchmarks/kv_map.py --blocks 10000   # a quick look

Pools: every block free; a busy pool (requests of 100 blocks, every other one finished with its blocks
cached, a prefix shared by 8 sequences); every block's state drawn at random (the worst case for the
encoding). The map is built once per heartbeat (HEARTBEAT_INTERVAL_S, 1 s by default), not per step.
Prints a table; writes JSON and a PNG plot to --out.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

from workloads import save_figure, write_json

from gpu_worker.engine.block_allocator import BlockAllocator
from shared.kv_map import STATE_NAMES, count_states, decode_states, encode_states

BLOCK_SIZE = 16
REQUEST_BLOCKS = 100


def busy_pool(num_blocks: int, seed: int) -> BlockAllocator:
    """Three quarters of the pool taken by requests; every other one finished with its blocks cached."""
    rng = random.Random(seed)
    allocator = BlockAllocator(num_blocks, BLOCK_SIZE)
    shared = allocator.allocate(REQUEST_BLOCKS)
    for _ in range(7):  # a prefix 8 sequences share
        allocator.fork(shared)
    for _ in range(3 * num_blocks // (4 * REQUEST_BLOCKS) - 1):
        table = allocator.allocate(REQUEST_BLOCKS)
        if rng.random() < 0.5:
            tokens = [rng.randrange(50_000) for _ in range(REQUEST_BLOCKS * BLOCK_SIZE)]
            allocator.cache_full_blocks(table, tokens, 0, REQUEST_BLOCKS, None)
            allocator.free(table)
    return allocator


def timed(make_states: Any, repeats: int) -> tuple[float, str]:
    """Milliseconds to build and encode the map, and the encoded map."""
    started = time.perf_counter()
    for _ in range(repeats):
        encoded = encode_states(make_states())
    return 1e3 * (time.perf_counter() - started) / repeats, encoded


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    random_states = bytes(rng.randrange(len(STATE_NAMES)) for _ in range(args.blocks))
    pools = {
        "all free": BlockAllocator(args.blocks, BLOCK_SIZE).block_states,
        "busy": busy_pool(args.blocks, args.seed).block_states,
        "random states": lambda: random_states,
    }
    rows = {}
    for name, make_states in pools.items():
        ms, encoded = timed(make_states, args.repeats)
        rows[name] = {"ms": ms, "bytes": len(encoded), "counts": count_states(decode_states(encoded))}
    print(f"| {args.blocks:,} blocks | encoded bytes | build + encode ms | blocks by state |")
    print("| --- | --- | --- | --- |")
    for name, row in rows.items():
        counts = ", ".join(f"{state} {n:,}" for state, n in row["counts"].items() if n)
        print(f"| {name} | {row['bytes']:,} | {row['ms']:.2f} | {counts} |")
    results = {"args": vars(args), "pools": rows}
    out = Path(args.out)
    path = write_json(results, out / "kv_map.json")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(list(rows), [r["bytes"] / 1024 for r in rows.values()])
    left.set(ylabel="KiB", title=f"encoded map, {args.blocks:,} blocks")
    right.bar(list(rows), [r["ms"] for r in rows.values()])
    right.set(ylabel="ms", title="build + encode, once a heartbeat")
    print(f"wrote {path} and {save_figure(fig, out / 'kv_map.png')}")
    return results


if __name__ == "__main__":
    main()
