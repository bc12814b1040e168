"""What routing by prefix costs, part by part, in one process: a worker's KV event publish per engine step,
and the scheduler's plan per request at many workers.

    .venv/bin/python benchmarks/routing_costs.py
    .venv/bin/python benchmarks/routing_costs.py --workers 10 --requests 2000 --steps 200   # a quick look

- publish: gpu_worker.kv_publisher.KVPublisher over a real block allocator against REDIS_URL (under a prefix
  of the run's own, deleted at the end): each step caches --per-step blocks (1, 16, 64) and frees them; the
  time of publish() per step (one MULTI: XADD, SADD, SREM).
- plan: scheduler_svc.admission.plan_admissions over --workers rooms and --requests queued prompts (a
  64-token prefix drawn from --prefixes by a Zipf law, plus 8 tokens of their own), once by load and once by
  prefix against an index where each worker holds 60 prefixes drawn the same way; the time per request of
  the plan, and of the index's match alone.

Prints a table; writes JSON and a PNG plot to --out.
"""

from __future__ import annotations

import argparse
import random
import time
import uuid
from pathlib import Path
from typing import Any

from workloads import save_figure, write_json

from gpu_worker.engine.block_allocator import BlockAllocator
from gpu_worker.kv_publisher import KVPublisher
from scheduler_svc.admission import WorkerRoom, plan_admissions
from scheduler_svc.prefix_index import PrefixIndex
from scheduler_svc.queue import QueuedRequest, WaitingQueue
from shared.keys import Keys
from shared.prefix import block_hashes
from shared.protocol import GenerateRequest
from shared.redis_client import connect
from shared.sampling import SamplingSpec

BLOCK_SIZE = 16
PREFIX_LEN, SUFFIX_LEN = 64, 8
HELD_PER_WORKER = 60


def publish_cost(redis_url: str, per_step: int, steps: int) -> float:
    """Microseconds per publish() of a step that cached per_step blocks."""
    client = connect(redis_url)
    keys = Keys(f"pagedserve-kvcost-{uuid.uuid4().hex[:8]}")
    allocator = BlockAllocator(4 * per_step + 16, BLOCK_SIZE)
    publisher = KVPublisher(client, keys, "w", allocator)
    publisher.publish()  # the registration's rewrite
    spent, first = 0.0, 0
    try:
        for _ in range(steps):
            table = allocator.allocate(per_step)
            tokens = list(range(first, first + per_step * BLOCK_SIZE))
            first += len(tokens)
            allocator.cache_full_blocks(table, tokens, 0, per_step, None)
            allocator.free(table)  # evictable: the next steps evict them, so events carry removals too
            started = time.perf_counter()
            publisher.publish()
            spent += time.perf_counter() - started
    finally:
        client.delete(keys.kv_blocks("w"), keys.kv_events("w"))
    return 1e6 * spent / steps


def zipf_prompts(rng: random.Random, prefixes: list[list[int]], count: int) -> list[list[int]]:
    weights = [1 / (k + 1) for k in range(len(prefixes))]
    picks = rng.choices(range(len(prefixes)), weights, k=count)
    return [prefixes[p] + [rng.randrange(50_000) for _ in range(SUFFIX_LEN)] for p in picks]


def plan_costs(workers: int, requests: int, num_prefixes: int, seed: int) -> dict[str, float]:
    """Microseconds per request of the plan by load and by prefix, and of the index's match alone."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50_000) for _ in range(PREFIX_LEN)] for _ in range(num_prefixes)]
    index = PrefixIndex()
    for w in range(workers):
        for prompt in zipf_prompts(rng, prefixes, HELD_PER_WORKER):
            index.store(f"w{w}", block_hashes(prompt[:PREFIX_LEN], BLOCK_SIZE))
    spec = SamplingSpec(max_tokens=1)
    entries = [
        QueuedRequest(f"1-{i}", GenerateRequest(request_id=f"r{i}", prompt_token_ids=p, sampling=spec,
                                                arrival_time=i))
        for i, p in enumerate(zipf_prompts(rng, prefixes, requests))
    ]  # fmt: skip

    def timed(matcher: Any) -> float:
        queue = WaitingQueue()
        for entry in entries:
            queue.push(entry)
        rooms = [WorkerRoom(f"w{w}", BLOCK_SIZE, 100_000, 100_002, 8192, 0, 0) for w in range(workers)]
        started = time.perf_counter()
        decisions = plan_admissions(queue, rooms, max_running=requests, matcher=matcher)
        assert len(decisions) == requests
        return 1e6 * (time.perf_counter() - started) / requests

    for entry in entries:
        entry.prompt_hashes(BLOCK_SIZE)  # computed once per request, on its first plan: not timed here
    started = time.perf_counter()
    for entry in entries:
        index.matches(entry.prompt_hashes(BLOCK_SIZE))
    match_us = 1e6 * (time.perf_counter() - started) / requests
    return {
        "load_us": timed(None),
        "prefix_us": timed(lambda entry, bs: index.matches(entry.prompt_hashes(bs))),
        "match_us": match_us,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--per-step", type=int, nargs="+", default=[1, 16, 64], help="blocks cached a step")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=100)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--prefixes", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--out", default="benchmarks/results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    publish = {n: publish_cost(args.redis_url, n, args.steps) for n in args.per_step}
    plan = plan_costs(args.workers, args.requests, args.prefixes, args.seed)
    print("| blocks cached a step | publish µs a step |\n| --- | --- |")
    for n, us in publish.items():
        print(f"| {n} | {us:.0f} |")
    print(
        f"\nplan of {args.requests:,} requests over {args.workers} workers, µs a request: by load "
        f"{plan['load_us']:.1f}, by prefix {plan['prefix_us']:.1f} "
        f"(the index's match alone {plan['match_us']:.1f})"
    )
    results = {"args": vars(args), "publish_us": publish, "plan_us": plan}
    out = Path(args.out)
    path = write_json(results, out / "routing_costs.json")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar([str(n) for n in publish], list(publish.values()))
    left.set(xlabel="blocks cached a step", ylabel="µs a step", title="KV event publish")
    right.bar(["load", "prefix", "match"], [plan["load_us"], plan["prefix_us"], plan["match_us"]])
    right.set(ylabel="µs a request", title=f"plan, {args.workers} workers")
    print(f"wrote {path} and {save_figure(fig, out / 'routing_costs.png')}")
    return results


if __name__ == "__main__":
    main()
