"""Where a workload's time goes in pagedserve, and what that allows against static batching.

    .venv/bin/python benchmarks/profile_steps.py --scale 0.5              # W2, the profile in the README
    .venv/bin/python benchmarks/profile_steps.py --workload W1 --scale 0.5
    .venv/bin/python benchmarks/profile_steps.py --dtype bfloat16         # W2 in bf16 (weights and KV cache)

Runs the workload through LLMEngine (after a warm-up on other token contents), timing every step with the
number of tokens it ran, and fits step seconds = fixed + per_token x tokens (least squares). `fixed` is what
a step costs whatever its size: on a CPU, streaming every weight from memory once, plus dispatch. The same
model prices transformers' static generate() over the same requests in batches of --static-batch-size:
each batch runs its longest prompt and longest output for every row. The ratio static / paged under that
model, and its ceiling when fixed costs nothing (padded tokens / useful tokens), bound what skipping padding
can win when both systems run the same matmuls. A second run under torch.profiler gives the ops that take
the time. Prints both; writes JSON and a PNG (step time against tokens, with the fit).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.profiler import ProfilerActivity, profile
from workloads import Workload, benchmark_parser, make_workload, save_figure

from gpu_worker import LLMEngine, SamplingParams
from gpu_worker.engine.step_scheduler import StepSchedule


def run_steps(engine: LLMEngine, workload: Workload, tag: str) -> list[tuple[int, float]]:
    """(tokens run, seconds) of every step that runs the whole workload."""
    for i, (prompt, o) in enumerate(zip(workload.prompts, workload.output_lens)):
        engine.add_request(
            f"{tag}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)
        )
    tokens: list[int] = []
    run = engine.runner.run

    def counting_run(out: StepSchedule, sample_rows: list[int]) -> torch.Tensor:
        tokens.append(sum(out.num_new_tokens))
        return run(out, sample_rows)

    engine.runner.run = counting_run  # type: ignore[method-assign]
    steps = []
    try:
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            steps.append((tokens[-1], time.perf_counter() - start))
    finally:
        engine.runner.run = run  # type: ignore[method-assign]
    for i in range(len(workload.prompts)):
        engine.release(f"{tag}-{i}")
    return steps


def fit(steps: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (fixed, per_token) of seconds = fixed + per_token * tokens."""
    x = torch.tensor([[1.0, n] for n, _ in steps], dtype=torch.float64)
    y = torch.tensor([[s] for _, s in steps], dtype=torch.float64)
    fixed, per_token = torch.linalg.lstsq(x, y).solution.flatten().tolist()
    return fixed, per_token


def static_shape(workload: Workload, batch_size: int) -> tuple[int, int]:
    """(steps, tokens with padding) of static generate(): per batch, its longest prompt and output per row."""
    steps = tokens = 0
    for b in range(0, len(workload.prompts), batch_size):
        prompts, outputs = workload.prompts[b : b + batch_size], workload.output_lens[b : b + batch_size]
        steps += max(outputs)  # one prefill step that gives the first token, then one per further token
        tokens += len(prompts) * (max(map(len, prompts)) + max(outputs) - 1)
    return steps, tokens


def top_ops(engine: LLMEngine, workload: Workload, limit: int = 12) -> list[dict[str, Any]]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_steps(engine, workload, "profiled")
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [
        {"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total,
         "calls": e.count}
        for e in events[:limit]
    ]  # fmt: skip


def plot(steps: list[tuple[int, float]], fixed: float, per_token: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([n for n, _ in steps], [1000 * s for _, s in steps], s=10, label="steps")
    top = max(n for n, _ in steps)
    ax.plot([0, top], [1000 * fixed, 1000 * (fixed + per_token * top)], "r-", label="fit")
    ax.set_xlabel("tokens in the step")
    ax.set_ylabel("step time (ms)")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = benchmark_parser(__doc__, "profile_steps")
    parser.add_argument("--workload", default="W2", choices=["W1", "W2", "W3"])
    parser.add_argument("--static-batch-size", type=int, default=64)
    parser.add_argument("--no-profiler", action="store_true", help="skip the torch.profiler run")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)

    engine = LLMEngine(args.model, device="cpu", dtype=args.dtype)
    make = lambda variant: make_workload(args.workload, engine.vocab_size, args.scale, args.seed, variant)  # noqa: E731
    run_steps(engine, make(99), "warm-up")
    workload = make(0)
    steps = run_steps(engine, workload, "timed")
    fixed, per_token = fit(steps)
    useful = workload.num_prompt_tokens + workload.num_output_tokens - len(workload.prompts)
    static_steps, static_tokens = static_shape(workload, args.static_batch_size)
    paged_s = sum(s for _, s in steps)
    static_s = fixed * static_steps + per_token * static_tokens
    model_paged_s = fixed * len(steps) + per_token * useful
    results: dict[str, Any] = {
        "args": vars(args),
        "threads": torch.get_num_threads(),
        "paged": {"steps": len(steps), "tokens": useful, "seconds": paged_s},
        "fit": {"fixed_ms": 1000 * fixed, "per_token_ms": 1000 * per_token},
        "fixed_share": fixed * len(steps) / paged_s,
        "static_model": {
            "batch_size": args.static_batch_size,
            "steps": static_steps,
            "tokens": static_tokens,
        },
        "static_over_paged_model": static_s / model_paged_s,
        "static_over_paged_ceiling": static_tokens / useful,
        "step_log": steps,
    }
    print(
        f"{args.workload} at scale {args.scale}, {args.dtype}: {len(steps)} steps, {useful} tokens, "
        f"{paged_s:.2f} s; "
        f"step = {1000 * fixed:.1f} ms + {1000 * per_token:.2f} ms/token "
        f"(fixed part {100 * results['fixed_share']:.0f}% of the time)"
    )
    print(
        f"static generate(), batch {args.static_batch_size}: {static_steps} steps, {static_tokens} tokens "
        f"with padding; at the same step costs static/paged = {results['static_over_paged_model']:.2f}x, "
        f"at most {results['static_over_paged_ceiling']:.2f}x (padded / useful tokens)"
    )
    if not args.no_profiler:
        results["top_ops"] = top_ops(engine, make(1))
        print(f"{'op':48} {'self s':>8} {'share':>6} {'calls':>7}")
        for row in results["top_ops"]:
            print(f"{row['op'][:48]:48} {row['self_s']:8.2f} {100 * row['share']:5.1f}% {row['calls']:7d}")
    out, png = Path(args.json), Path(args.plot)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(steps, fixed, per_token, png)
    print(f"wrote {out} and {png}")
    return results


if __name__ == "__main__":
    main()
