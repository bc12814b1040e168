"""The engine's steps against this machine's limits: how far each step is from what memory and matmuls allow.

    .venv/bin/python benchmarks/roofline.py                       # the default model, fp32, about 1 min
    .venv/bin/python benchmarks/roofline.py --batches 1 32 --steps 10 --model-impl pagedserve

Measures, in the same run, this machine's read bandwidth (summing a large fp32 tensor), copy bandwidth (bytes
read plus written by a large copy) and matmul rates (the best of square fp32 and bf16 matmuls), then times
steps of the engine (LLMEngine, fp32 by default): decode steps at each batch size (that many requests, each
past a short prompt, one token each per step) and one prefill chunk. Each step is set against two bounds:

- memory: every weight byte read once (the tied embedding is read whole by the LM head) over the read
  bandwidth; a step cannot take less, whatever its batch. On a shared machine the bandwidth moves from minute
  to minute, so each step's bound takes the bandwidth measured around its own timing (the better of a
  measure just before and one just after);
- compute: the step's FLOPs (2 x parameters x tokens, the LM head on the sampled rows, attention over the
  context) over the fp32 matmul rate, and over the bf16 rate (what bf16 weights could reach). A step's
  "x bound" is over the higher of the memory bound and the compute bound of the dtype it runs in.

Three forwards run by default, one after the other against the same measured limits (`--model-impl`):
transformers' modules, pagedserve's own with a Python loop over the layers, and pagedserve's own with a decode
step's layers in one C++ call (what the engine runs). A profile of each row (torch.profiler, five decode
steps averaged, or the prefill step) says where the time goes: matmuls, attention, the rest of the ops, and
what is outside every op (Python, dispatch). The profiler's own cost per recorded op lands mostly in
"outside": the last column says how much longer a profiled step took than the timed ones. Prints a table;
writes JSON and a PNG.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.profiler import ProfilerActivity, profile
from workloads import ModelShape, benchmark_parser, matmul_flops_per_s, save_figure, write_json

from gpu_worker import LLMEngine, SamplingParams
from gpu_worker.engine.config import EngineConfig
from gpu_worker.engine.llama_forward import LlamaForward
from gpu_worker.engine.packed_linear import cpu_has_bf16, own_bf16_panels

PROMPT_LEN = 32
# Decode steps profiled per batch size (one step's profile moves by several points from run to run).
PROFILED_STEPS = 5
# Op names by kind, for the profile's summary (the rest is "other ops").
MATMUL_OPS = (
    "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "mkldnn::_linear_pointwise",
    "pagedserve_cpu::packed_linear",
)  # fmt: skip
ATTENTION_OPS = ("attention", "scaled_dot_product")
# The forwards compared: (the engine's model_impl, a decode step's layers in one C++ call).
FORWARDS = {
    "transformers": ("transformers", False),
    "pagedserve-py": ("pagedserve", False),
    "pagedserve": ("pagedserve", True),
}


def read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second read by a sum over a tensor far larger than the caches (the best of repeats)."""
    data = torch.ones(num_bytes // 4)
    best = min(_timed(lambda: data.sum()) for _ in range(repeats + 1))
    return num_bytes / best


def copy_bandwidth(num_bytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes per second read and written by a copy (both counted), the best of repeats."""
    src, dst = torch.ones(num_bytes // 4), torch.empty(num_bytes // 4)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats + 1))
    return 2 * num_bytes / best


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weight_bytes(model: Any) -> int:
    """Bytes a step reads from weights: every parameter once, except input embeddings that are not also the
    LM head (a step gathers a few of their rows; the CPU's packed head is a copy of a tied embedding)."""
    embeddings = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    skip = () if head is not None and head.weight is embeddings else (id(embeddings),)
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


def step_flops(shape: ModelShape, num_tokens: int, num_sampled: int, context_lens: list[int]) -> float:
    """FLOPs of one step: the layers over every token, the LM head over the sampled rows, and attention of
    each new token over its context (QK^T and PV)."""
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * sum(context_lens)
    head = 2 * shape.vocab_size * shape.hidden_size * num_sampled
    return 2 * shape.num_params_without_embeddings * num_tokens + head + attention


@contextlib.contextmanager
def decoding(engine: LLMEngine, batch: int, num_steps: int, tag: str) -> Iterator[None]:
    """`batch` requests past their prompts and their first decode step, each with num_steps more to run; they
    are aborted afterwards (which frees their blocks and forgets them)."""
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 4, ignore_eos=True)
    for i in range(batch):
        prompt = [(17 + 7 * i + 3 * j) % 1000 + 10 for j in range(PROMPT_LEN)]
        engine.add_request(f"{tag}-{i}", prompt, params)
    running = engine.step_scheduler.running
    while engine.step_scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in running):
        engine.step()
    engine.step()  # every request's first decode step (warm)
    try:
        yield
    finally:
        for i in range(batch):
            engine.abort_request(f"{tag}-{i}")


def prefill_step(engine: LLMEngine, num_tokens: int, salt: int) -> float:
    """Seconds of one step that prefills a num_tokens prompt (and samples its first token); each salt makes a
    prompt of its own, so no step finds its prompt in the prefix cache."""
    tag = f"prefill-{salt}"
    prompt = [(13 + 5 * j + 7 * salt * (j + 1)) % 1000 + 10 for j in range(num_tokens)]
    engine.add_request(tag, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    seconds = _timed(engine.step)
    while engine.has_unfinished_requests():
        engine.step()
    engine.release(tag)
    return seconds


def profile_of(run: Any, calls: int = 1) -> dict[str, float]:
    """Where a call's time goes, averaged over `calls` calls: seconds in matmul ops, attention ops, other ops,
    and outside every op. The profiler's own cost per recorded op is in these seconds too, most of it in
    "outside" (the table's "profiled" column says how much longer a profiled call took)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            run()
        wall = (time.perf_counter() - start) / calls
    kinds = {"matmul_s": 0.0, "attention_s": 0.0, "other_ops_s": 0.0}
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6 / calls
        if event.key in MATMUL_OPS:
            kinds["matmul_s"] += seconds
        elif any(name in event.key.lower() for name in ATTENTION_OPS):
            kinds["attention_s"] += seconds
        else:
            kinds["other_ops_s"] += seconds
    kinds["outside_ops_s"] = max(0.0, wall - sum(kinds.values()))
    kinds["profiled_wall_s"] = wall
    return kinds


def row(
    name: str,
    seconds: float,
    flops: float,
    limits: dict[str, float],
    weights: int,
    where: dict[str, float],
    dtype: str,
) -> dict[str, Any]:
    """A step against the bounds: its over_bound is over the higher of memory and its own dtype's FLOPs. The
    memory bound is over limits' read bandwidth: the one measured around this step (timed_beside)."""
    memory_s = weights / limits["read_bytes_per_s"]
    fp32_s = flops / limits["fp32_matmul_flops_per_s"]
    bf16_s = flops / limits["bf16_matmul_flops_per_s"]
    compute_s = bf16_s if dtype == "bfloat16" else fp32_s
    bound = max(memory_s, compute_s)
    return {
        "step": name,
        "step_s": seconds,
        "read_bytes_per_s": limits["read_bytes_per_s"],
        "memory_bound_s": memory_s,
        "fp32_compute_bound_s": fp32_s,
        "bf16_compute_bound_s": bf16_s,
        "bound": "memory" if memory_s >= compute_s else "compute",
        "over_bound": seconds / bound,
        "achieved_flops_per_s": flops / seconds,
        "flops": flops,
        "where": where,
    }


def print_table(results: dict[str, Any]) -> None:
    limits = results["machine"]
    read, copy = limits["read_bytes_per_s"] / 1e9, limits["copy_bytes_per_s"] / 1e9
    fp32, bf16 = limits["fp32_matmul_flops_per_s"] / 1e9, limits["bf16_matmul_flops_per_s"] / 1e9
    print(
        f"read {read:.1f} GB/s, copy {copy:.1f} GB/s, fp32 matmul {fp32:.0f} GFLOP/s, bf16 matmul {bf16:.0f}"
        f" GFLOP/s; weights {results['weight_bytes'] / 1e6:.0f} MB ({results['dtype']}), {results['threads']}"
        " threads"
    )
    print(
        f"{'forward':<14}{'step':<14}{'ms':>8}{'GB/s':>7}{'mem ms':>8}{'fp32 ms':>9}{'bf16 ms':>9}"
        f"{'x bound':>9}{'matmul':>8}{'attn':>7}{'ops':>7}{'outside':>9}{'profiled':>10}"
    )
    for r in results["rows"]:
        w = r["where"]
        wall = w["profiled_wall_s"]
        shares = [w[k] / wall for k in ("matmul_s", "attention_s", "other_ops_s", "outside_ops_s")]
        print(
            f"{r['model_impl']:<14}{r['step']:<14}"
            f"{1000 * r['step_s']:>8.1f}{r['read_bytes_per_s'] / 1e9:>7.1f}{1000 * r['memory_bound_s']:>8.1f}"
            f"{1000 * r['fp32_compute_bound_s']:>9.1f}{1000 * r['bf16_compute_bound_s']:>9.1f}"
            f"{r['over_bound']:>8.2f}x"
            + "".join(f"{s:>7.0%} " for s in shares)
            + f"{wall / r['step_s'] - 1:>+9.0%}"
        )


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r["step"].startswith("decode")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for impl in dict.fromkeys(r["model_impl"] for r in rows):
        mine = [r for r in rows if r["model_impl"] == impl]
        steps = [int(r["step"].split()[-1]) for r in mine]
        ax.plot(steps, [1000 * r["step_s"] for r in mine], "o-", label=f"decode step ({impl} forward)")
    rows = [r for r in rows if r["model_impl"] == rows[-1]["model_impl"]]
    batches = [int(r["step"].split()[-1]) for r in rows]
    ax.plot(batches, [1000 * r["memory_bound_s"] for r in rows], "--", label="weights / read bandwidth")
    ax.plot(batches, [1000 * r["fp32_compute_bound_s"] for r in rows], ":", label="FLOPs / fp32 matmul rate")
    ax.plot(batches, [1000 * r["bf16_compute_bound_s"] for r in rows], ":", label="FLOPs / bf16 matmul rate")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests decoding (tokens per step)")
    ax.set_ylabel("ms per step")
    ax.set_title(f"decode steps against this machine's limits ({results['dtype']})")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = benchmark_parser(__doc__, "roofline")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prefill-tokens", type=int, default=512, help="the prefill chunk's length")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--model-impl",
        default="all",
        choices=["all", *FORWARDS],
        help="the forward: transformers' modules, pagedserve's with a Python loop over the layers, or with a "
        "decode step's layers in one C++ call (the default); all: the three, one after the other",
    )
    args = parser.parse_args(argv)

    cpu = torch.device("cpu")
    limits = {
        "read_bytes_per_s": read_bandwidth(),
        "copy_bytes_per_s": copy_bandwidth(),
        "fp32_matmul_flops_per_s": matmul_flops_per_s(cpu),
    }
    # Without bf16 instructions the panel kernel widens bf16 weights to float32 (own_bf16_panels), so its rate
    # is float32's; where it cannot, oneDNN emulates bf16, far slower: a small matmul tells as much.
    limits["bf16_matmul_flops_per_s"] = (
        limits["fp32_matmul_flops_per_s"]
        if own_bf16_panels()
        else matmul_flops_per_s(cpu, n=2048 if cpu_has_bf16() else 256, dtype=torch.bfloat16)
    )
    impls = list(FORWARDS) if args.model_impl == "all" else [args.model_impl]
    rows: list[dict[str, Any]] = []
    for impl in impls:
        model_impl, cpp_layers = FORWARDS[impl]
        config = EngineConfig(model_impl=model_impl)
        engine = LLMEngine(args.model, config, device="cpu", dtype=getattr(torch, args.dtype))
        forward = engine.runner.model
        if isinstance(forward, LlamaForward):
            forward.use_cpp_layers = cpp_layers and forward.decode_weights is not None
        shape = ModelShape.of(engine.runner.model)
        weights = weight_bytes(engine.runner.model)
        for r in steps_of(engine, args, shape, weights, limits):
            rows.append({**r, "model_impl": impl})
        del engine
    results = {
        "model": str(args.model or "SmolLM2-135M-Instruct"),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "machine": limits,
        "weight_bytes": weights,
        "shape": dataclasses.asdict(shape),
        "rows": rows,
    }
    print_table(results)
    out, png = Path(args.json), Path(args.plot)
    write_json(results, out)
    plot(results, png)
    print(f"wrote {out} and {png}")
    return results


def steps_of(
    engine: LLMEngine, args: Any, shape: ModelShape, weights: int, limits: dict[str, float]
) -> list[dict[str, Any]]:
    """The decode steps at each batch size and one prefill chunk, each against the bounds."""
    with decoding(engine, max(args.batches), 3, "warm-up"):
        for _ in range(3):
            engine.step()
    rows = []
    for batch in args.batches:
        with decoding(engine, batch, args.steps + PROFILED_STEPS, f"decode-{batch}"):
            seconds, read = timed_beside(lambda: median_step(engine.step, args.steps))
            where = profile_of(engine.step, PROFILED_STEPS)
        context = [PROMPT_LEN + 2 + args.steps // 2] * batch
        flops = step_flops(shape, batch, batch, context)
        rows.append(row(f"decode {batch}", seconds, flops, {**limits, **read}, weights, where, args.dtype))
    n = args.prefill_tokens
    seconds, read = timed_beside(lambda: statistics.median(prefill_step(engine, n, s) for s in range(1, 4)))
    flops = step_flops(shape, n, 1, list(range(1, n + 1)))
    where = profile_of(lambda: prefill_step(engine, n, 4))
    rows.append(row(f"prefill {n}", seconds, flops, {**limits, **read}, weights, where, args.dtype))
    return rows


def median_step(step: Any, times: int) -> float:
    return statistics.median(_timed(step) for _ in range(times))


def timed_beside(timing: Any) -> tuple[float, dict[str, float]]:
    """timing()'s seconds, and the read bandwidth around it: the better of a measure just before and one just
    after, so that a step is set against what memory gave at the time it ran."""
    before = read_bandwidth(repeats=2)
    seconds = timing()
    return seconds, {"read_bytes_per_s": max(before, read_bandwidth(repeats=2))}


if __name__ == "__main__":
    main()
