"""Decode steps with the packed weights and the KV pool on 4 KiB pages against transparent huge pages, paired
in one process: two engines of the same model, one built with PAGEDSERVE_HUGE_PAGES=0, stepping in turn.

    .venv/bin/python benchmarks/huge_pages.py                              # bf16 where the CPU has it, ~2 min
    .venv/bin/python benchmarks/huge_pages.py --dtype float32 --batches 1 32

On a machine whose speed drifts from minute to minute, runs of one setting after the other measure the drift;
steps taken in turn (each pair in alternating order) see the same machine. Each batch size runs --steps decode
steps per engine past 32-token prompts (benchmarks/roofline.py's requests). Prints each engine's median and
fastest step, and the ratio of the medians; writes JSON and a plot.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Any
from unittest import mock

import torch
from roofline import decoding
from workloads import benchmark_parser, save_figure, write_json

from gpu_worker import LLMEngine
from gpu_worker.engine.config import EngineConfig
from gpu_worker.engine.packed_linear import cpu_has_bf16

SETTINGS = {"4 KiB pages": "0", "huge pages": "1"}  # PAGEDSERVE_HUGE_PAGES when each engine is built


def engine_with(setting: str, args: Any, dtype: torch.dtype) -> LLMEngine:
    with mock.patch.dict(os.environ, {"PAGEDSERVE_HUGE_PAGES": setting}):
        config = EngineConfig(model_impl="pagedserve", kv_cache_memory_bytes=args.kv_mib << 20)
        return LLMEngine(args.model, config, device="cpu", dtype=dtype)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = benchmark_parser(__doc__, "huge_pages")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per engine and batch size")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--kv-mib", type=int, default=512, help="each engine's KV pool")
    args = parser.parse_args(argv)
    name = args.dtype if args.dtype != "auto" else "bfloat16" if cpu_has_bf16() else "float32"
    dtype = getattr(torch, name)
    engines = {label: engine_with(setting, args, dtype) for label, setting in SETTINGS.items()}
    results: dict[str, Any] = {"dtype": name, "threads": torch.get_num_threads(), "rows": []}
    for batch in args.batches:
        times: dict[str, list[float]] = {label: [] for label in engines}
        with contextlib.ExitStack() as stack:
            for label, engine in engines.items():
                stack.enter_context(decoding(engine, batch, args.steps + 4, f"{label}-{batch}"))
            for _ in range(2):  # warm
                for engine in engines.values():
                    engine.step()
            pairs = list(engines.items())
            for i in range(args.steps):
                for label, engine in pairs if i % 2 == 0 else pairs[::-1]:
                    start = time.perf_counter()
                    engine.step()
                    times[label].append(time.perf_counter() - start)
        row: dict[str, Any] = {"batch": batch}
        for label, seconds in times.items():
            row[label] = {"median_s": statistics.median(seconds), "min_s": min(seconds)}
        small, huge = (row[label]["median_s"] for label in SETTINGS)
        row["huge_over_small"] = huge / small
        results["rows"].append(row)
        print(f"batch {batch:3d}: " + "; ".join(
            f"{label} median {1e3 * row[label]['median_s']:.2f} ms (fastest {1e3 * row[label]['min_s']:.2f})"
            for label in SETTINGS) + f"; huge / 4 KiB {row['huge_over_small']:.3f}")  # fmt: skip
    plot(results, args.plot)
    print(f"wrote {write_json(results, args.json)} and {args.plot}")
    return results


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = results["rows"]
    width = 0.4
    for j, label in enumerate(SETTINGS):
        xs = [i + (j - 0.5) * width for i in range(len(rows))]
        ax.bar(xs, [1e3 * r[label]["median_s"] for r in rows], width, label=label)
    ax.set_xticks(range(len(rows)), [str(r["batch"]) for r in rows])
    ax.set_xlabel("requests decoding")
    ax.set_ylabel("median ms per step")
    ax.set_title(f"decode steps, packed weights and KV pool on each page size ({results['dtype']})")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
