"""KV memory during W2: paged blocks against a contiguous max-length reservation, in the same budget.

    .venv/bin/python benchmarks/memory.py                        # W2 (64 mixed requests), 512 MiB of KV
    .venv/bin/python benchmarks/memory.py --scale 0.25 --kv-budget-mib 64

Drives LLMEngine directly (all requests added at once, greedy, ignore_eos) and samples after every step:
the fraction of allocated KV slots that hold live tokens (EngineStats.slot_utilization), and the fraction a
contiguous scheme would use for the same running set, had it reserved prompt + max_tokens per request. Also
the peak number of sequences running at once against the most a contiguous scheme fits in the same budget.
Prints a table; writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from workloads import DESCRIPTIONS, benchmark_parser, make_workload, save_figure

from gpu_worker import LLMEngine, SamplingParams
from gpu_worker.engine.config import EngineConfig
from gpu_worker.engine.model_loader import resolve_model_path


def contiguous_peak(reservations: list[int], capacity: int) -> int:
    """The most requests a contiguous scheme holds at once: at best, the smallest reservations first."""
    used = count = 0
    for r in sorted(reservations):
        if used + r > capacity:
            break
        used += r
        count += 1
    return count


def trace(engine: LLMEngine, prompts: list[list[int]], output_lens: list[int]) -> list[dict[str, Any]]:
    """One sample after every engine step until every request has finished."""
    for i, (prompt, o) in enumerate(zip(prompts, output_lens)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True))
    samples = []
    start = time.perf_counter()
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        stats = engine.stats()
        running = engine.step_scheduler.running
        reserved = sum(seq.num_prompt_tokens + (seq.params.max_tokens or 0) for seq in running)
        samples.append(
            {
                "step": step,
                "seconds": time.perf_counter() - start,
                "num_running": stats.num_running,
                "num_waiting": stats.num_waiting,
                "num_live_token_slots": stats.num_live_token_slots,
                "num_allocated_slots": stats.num_allocated_slots,
                "num_reserved_slots_contiguous": reserved,
                "paged_utilization": stats.slot_utilization,
                "contiguous_utilization": stats.num_live_token_slots / reserved if reserved else 1.0,
                "num_preemptions": stats.num_preemptions,
            }
        )
    for i in range(len(prompts)):
        engine.release(str(i))
    return samples


def plot(samples: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["seconds"] for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(t, [s["paged_utilization"] for s in samples], label="paged: live / allocated slots")
    top.plot(t, [s["contiguous_utilization"] for s in samples], label="contiguous: live / reserved slots")
    top.set_ylim(0, 1.05)
    top.set_ylabel("KV slots in use")
    top.legend(loc="lower left")
    bottom.plot(t, [s["num_running"] for s in samples], label="sequences running")
    bottom.plot(t, [s["num_allocated_slots"] for s in samples], label="allocated slots (paged)")
    bottom.plot(t, [s["num_live_token_slots"] for s in samples], label="live token slots")
    bottom.set_yscale("log")
    bottom.set_xlabel("seconds")
    bottom.legend(loc="lower left")
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__, "memory")
    parser.add_argument("--kv-budget-mib", type=float, default=512, help="KV budget of both schemes")
    parser.add_argument("--block-size", type=int, default=16)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    config = EngineConfig(
        block_size=args.block_size,
        kv_cache_memory_bytes=int(args.kv_budget_mib * (1 << 20)),
        max_num_batched_tokens=2048,
        max_num_seqs=256,
    )
    path = resolve_model_path(args.model)
    engine = LLMEngine(path, config, dtype="float32")
    wl = make_workload("W2", engine.vocab_size, args.scale, args.seed)
    samples = trace(engine, wl.prompts, wl.output_lens)
    capacity = engine.allocator.num_blocks * engine.config.block_size
    busy = [s for s in samples if s["num_running"]]
    peak = max(busy, key=lambda s: s["num_allocated_slots"])
    reservations = [len(p) + o for p, o in zip(wl.prompts, wl.output_lens)]
    summary = {
        "peak_concurrent_paged": max(s["num_running"] for s in samples),
        "peak_concurrent_contiguous": contiguous_peak(reservations, capacity),
        "peak_concurrent_contiguous_worst_case": min(
            len(reservations), capacity // (wl.max_input_len + wl.max_output_len)
        ),
        "paged_utilization_at_peak": peak["paged_utilization"],
        "contiguous_utilization_at_peak": peak["contiguous_utilization"],
        "paged_utilization_mean": sum(s["paged_utilization"] for s in busy) / len(busy),
        "contiguous_utilization_mean": sum(s["contiguous_utilization"] for s in busy) / len(busy),
        "paged_utilization_min": min(s["paged_utilization"] for s in busy),
        "peak_allocated_slots": peak["num_allocated_slots"],
        "num_preemptions": samples[-1]["num_preemptions"],
        "num_steps": len(samples),
    }
    results = {
        "args": vars(args),
        "model": path,
        "device": str(engine.device),
        "workload": DESCRIPTIONS["W2"],
        "num_requests": len(wl.prompts),
        "kv_budget_bytes": config.kv_cache_memory_bytes,
        "capacity_slots": capacity,
        "notes": {
            "paged_utilization": "EngineStats.slot_utilization: live token slots / slots of allocated blocks",
            "contiguous_utilization": "live token slots / sum of prompt + max_tokens of running requests",
            "peak_concurrent_contiguous": "requests whose prompt + max_tokens reservations fit in the budget "
            "together, smallest first (the best a contiguous scheme can do)",
            "peak_concurrent_contiguous_worst_case": "requests that fit when each reserves the workload's "
            "longest prompt + longest output (what a scheme that cannot see lengths must do)",
            "at_peak": "the step with the most allocated slots",
        },
        "summary": summary,
        "samples": samples,
    }
    print(f"W2 ({len(wl.prompts)} requests) in {args.kv_budget_mib:g} MiB of KV = {capacity} slots, {path}")
    print(f"{'':44} {'paged':>8} {'contiguous':>11}")
    print(
        f"{'live / allocated (reserved) slots, at peak':44} {summary['paged_utilization_at_peak']:8.1%}"
        f" {summary['contiguous_utilization_at_peak']:11.1%}"
    )
    print(
        f"{'live / allocated (reserved) slots, mean':44} {summary['paged_utilization_mean']:8.1%}"
        f" {summary['contiguous_utilization_mean']:11.1%}"
    )
    print(
        f"{'peak concurrent sequences':44} {summary['peak_concurrent_paged']:8d}"
        f" {summary['peak_concurrent_contiguous']:11d}"
        f" (worst case {summary['peak_concurrent_contiguous_worst_case']})"
    )
    print(f"{summary['num_steps']} steps, {summary['num_preemptions']} preemptions")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(samples, Path(args.plot))
    print(f"wrote {out} and {args.plot}")
    return results


if __name__ == "__main__":
    main()
