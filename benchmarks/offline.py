"""Offline throughput: pagedserve against transformers' static and continuous batching, side by side.

    .venv/bin/python benchmarks/offline.py --repeats 3                  # W1, W2, W3 and W2 at equal memory
    .venv/bin/python benchmarks/offline.py --workloads W2 --scale 0.25  # a quick run

Workloads (random-token prompts from fixed seeds, greedy, ignore_eos): W1 uniform, W2 mixed lengths, W3 a
shared 256-token prefix, and W2eq: W2 with every system held to the same KV budget (--kv-budget-mib).
Systems, interleaved in one process: pagedserve's LLM.generate; transformers' static batched generate()
(left-padded batches, each run to its longest output); transformers' continuous batching (the manager
behind model.generate_batch, fed one request at a time so each gets its own output length). Each repeat
draws fresh token contents of the same shapes, so no prefix-cache hit crosses repeats. Prints a table;
writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
from transformers.utils import logging as hf_logging
from workloads import (
    DESCRIPTIONS,
    FLOPS_FORMULA,
    WORKLOADS,
    ModelShape,
    Workload,
    benchmark_parser,
    make_workload,
    matmul_flops_per_s,
    median,
    percentile,
    save_figure,
)

from gpu_worker import LLM, LLMEngine, SamplingParams
from gpu_worker.engine.model_loader import resolve_model_path

EQUAL_MEMORY = "W2eq"
CB_PAGE_SIZE = 32
MAX_BATCHED_TOKENS = 2048
MAX_NUM_SEQS = 256
# --systems: each kind by the start of its systems' names.
SYSTEM_KINDS = {"pagedserve": "pagedserve", "static": "static generate()", "continuous": "transformers"}


def paged_params(workload: Workload) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in workload.output_lens]


def run_paged(llm: LLM, workload: Workload) -> float:
    params = paged_params(workload)
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == workload.output_lens
    return elapsed


def paged_ttft(engine: LLMEngine, workload: Workload, tag: str) -> list[float]:
    """Seconds from adding every request to each one's first token; the rest of the work is then aborted."""
    ids = [f"ttft-{tag}-{i}" for i in range(len(workload.prompts))]
    for request_id, prompt, params in zip(ids, workload.prompts, paged_params(workload)):
        engine.add_request(request_id, prompt, params)
    start = time.perf_counter()
    first: dict[str, float] = {}
    while len(first) < len(ids):
        for seq in engine.step():
            first.setdefault(seq.request_id, time.perf_counter() - start)
    for request_id in ids:
        engine.abort_request(request_id)
    return [first[i] for i in ids]


def run_static(model: Any, workload: Workload, batch_size: int, pad_id: int) -> float:
    """transformers' generate() over left-padded batches in arrival order, each run to its longest output."""
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), batch_size):
        batch = workload.prompts[i : i + batch_size]
        output_len = max(workload.output_lens[i : i + batch_size])
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                ids.to(model.device),
                attention_mask=mask.to(model.device),
                do_sample=False,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                pad_token_id=pad_id,
            )
        assert out.shape[1] == width + output_len
    return time.perf_counter() - start


def run_continuous(model: Any, workload: Workload, num_blocks: int, pad_id: int) -> float:
    """transformers' continuous batching manager (what generate_batch runs), with a KV pool of num_blocks."""
    generation_config = GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=pad_id, max_new_tokens=workload.max_output_len
    )
    cb_config = ContinuousBatchingConfig(
        page_size=CB_PAGE_SIZE,
        num_blocks=num_blocks,
        max_batch_tokens=MAX_BATCHED_TOKENS,
        max_requests_per_batch=MAX_NUM_SEQS,
    )
    expected = {f"req-{i}": o for i, o in enumerate(workload.output_lens)}
    with model.continuous_batching_context_manager(
        generation_config=generation_config, continuous_batching_config=cb_config, timeout=30
    ) as manager:
        start = time.perf_counter()
        for (request_id, output_len), prompt in zip(expected.items(), workload.prompts):
            manager.add_request(prompt, request_id=request_id, max_new_tokens=output_len)
        done = 0
        while done < len(expected):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("the generation thread stopped before every request finished")
                continue
            if result.is_finished():
                if result.error:
                    raise RuntimeError(result.error)
                got = len(result.generated_tokens)
                if got != expected[result.request_id]:
                    raise RuntimeError(
                        f"{result.request_id}: {got} tokens, {expected[result.request_id]} asked"
                    )
                done += 1
        elapsed = time.perf_counter() - start
    return elapsed


class Bench:
    """The models, the systems of each workload, and their timings."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.path = resolve_model_path(args.model)
        self.model = (
            AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).to(self.device).eval()
        )
        self.shape = ModelShape.of(self.model)
        self.pad_id = self.model.generation_config.pad_token_id or 0
        self.bytes_per_token = self.shape.kv_bytes_per_token(torch.float32)
        self.pool_bytes = args.pool_mib << 20
        self.budget_bytes = int(args.kv_budget_mib * (1 << 20))
        self.llms: dict[str, LLM] = {}
        self.errors: dict[tuple[str, str], str] = {}
        self.seconds: dict[tuple[str, str], list[float]] = {}
        self.batch_sizes: dict[tuple[str, str], int] = {}

    def llm(self, name: str, pool_bytes: int, prefix_caching: bool = True) -> LLM:
        if name not in self.llms:
            self.llms[name] = LLM(
                self.path,
                dtype=self.args.dtype,
                device=self.device,
                kv_cache_memory_bytes=pool_bytes,
                max_num_batched_tokens=MAX_BATCHED_TOKENS,
                max_num_seqs=MAX_NUM_SEQS,
                enable_prefix_caching=prefix_caching,
            )
        return self.llms[name]

    def workload(self, key: str, variant: int, scale: float | None = None) -> Workload:
        name = "W2" if key == EQUAL_MEMORY else key
        scale = self.args.scale if scale is None else scale
        return make_workload(name, self.shape.vocab_size, scale, self.args.seed, variant)

    def systems(self, key: str) -> list[tuple[str, Callable[[Workload], float]]]:
        """(name, run) for every system of a workload; run returns seconds."""
        if key == EQUAL_MEMORY:
            pool = self.budget_bytes
            wl = self.workload(key, 0)
            # A contiguous scheme reserves the longest prompt and output the workload allows, per request.
            batch = min(
                len(wl.prompts), pool // (self.bytes_per_token * (wl.max_input_len + wl.max_output_len))
            )
            static_batches = [batch] if batch else []
            if not batch:
                self.errors[(key, "static generate()")] = "not one request fits the KV budget"
        else:
            pool = self.pool_bytes
            static_batches = self.args.static_batch_sizes
        llm = self.llm("eq" if key == EQUAL_MEMORY else "main", pool)
        out: list[tuple[str, Callable[[Workload], float]]] = [("pagedserve", lambda wl: run_paged(llm, wl))]
        if key == "W3":
            out[0] = ("pagedserve, prefix caching", out[0][1])
            no_prefix = self.llm("no-prefix", pool, prefix_caching=False)
            out.append(("pagedserve, no prefix caching", lambda wl: run_paged(no_prefix, wl)))
        for b in static_batches:
            name = f"static generate() batch={b}"
            self.batch_sizes[(key, name)] = b
            out.append((name, lambda wl, b=b: run_static(self.model, wl, b, self.pad_id)))
        num_blocks = pool // (CB_PAGE_SIZE * self.bytes_per_token)
        out.append(
            (
                "transformers continuous batching",
                lambda wl: run_continuous(self.model, wl, num_blocks, self.pad_id),
            )
        )
        return out

    def time_one(
        self, key: str, name: str, run: Callable[[Workload], float], wl: Workload, record: bool = True
    ) -> None:
        if (key, name) in self.errors:
            return
        try:
            seconds = run(wl)
            if record:
                self.seconds.setdefault((key, name), []).append(seconds)
                print(f"  {key} {name}: {seconds:.2f} s", flush=True)
        except Exception as e:
            if not name.startswith("transformers"):
                raise
            self.errors[(key, name)] = f"{type(e).__name__}: {e}"[:300]


def summarize(
    bench: Bench, key: str, names: list[str], flops: float, wl: Workload, peak: float
) -> dict[str, Any]:
    rows = []
    static = [
        median(bench.seconds[(key, n)]) for n in names if n.startswith("static") and (key, n) in bench.seconds
    ]
    best_static = min(static) if static else None
    for name in names:
        row: dict[str, Any] = {"system": name}
        if (key, name) in bench.batch_sizes:
            row["batch_size"] = bench.batch_sizes[(key, name)]
        times = bench.seconds.get((key, name))
        if not times or (key, name) in bench.errors:
            row["error"] = bench.errors.get((key, name), "not run")
            rows.append(row)
            continue
        seconds = median(times)
        row.update(
            seconds=seconds,
            seconds_min=min(times),
            seconds_max=max(times),
            all_seconds=times,
            output_tokens_per_s=wl.num_output_tokens / seconds,
            output_tokens_per_s_min=wl.num_output_tokens / max(times),
            output_tokens_per_s_max=wl.num_output_tokens / min(times),
            processed_tokens_per_s=(wl.num_prompt_tokens + wl.num_output_tokens) / seconds,
            achieved_flops_per_s=flops / seconds,
            mfu=flops / seconds / peak,
            vs_best_static=best_static / seconds if best_static else None,
        )
        rows.append(row)
    return {
        "description": DESCRIPTIONS["W2"] if key == EQUAL_MEMORY else DESCRIPTIONS[key],
        "num_requests": len(wl.prompts),
        "num_prompt_tokens": wl.num_prompt_tokens,
        "num_output_tokens": wl.num_output_tokens,
        "flops": flops,
        "systems": rows,
    }


def print_table(results: dict[str, Any]) -> None:
    header = f"{'workload':9} {'system':34} {'seconds (min-max)':>20} {'out tok/s':>10} {'proc tok/s':>10}"
    print(header + f" {'MFU':>6} {'vs static':>9}")
    for key, wl in results["workloads"].items():
        for row in wl["systems"]:
            if "error" in row:
                print(f"{key:9} {row['system']:34} n/a: {row['error']}")
                continue
            spread = f"{row['seconds']:.2f} ({row['seconds_min']:.2f}-{row['seconds_max']:.2f})"
            ratio = f"{row['vs_best_static']:.2f}x" if row["vs_best_static"] else "-"
            print(
                f"{key:9} {row['system']:34} {spread:>20} {row['output_tokens_per_s']:10.1f}"
                f" {row['processed_tokens_per_s']:10.1f} {row['mfu']:6.1%} {ratio:>9}"
            )
        if "ttft" in wl:
            for name, t in wl["ttft"].items():
                print(
                    f"{key:9} TTFT {name:29} mean {t['mean_s'] * 1000:.1f} ms, p50 {t['p50_s'] * 1000:.1f} ms"
                )


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results["workloads"])
    cols = min(2, len(keys))
    rows_of_plots = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows_of_plots, cols, figsize=(6.5 * cols, 3 * rows_of_plots), squeeze=False)
    for ax in axes.flat[len(keys) :]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys):
        rows = [r for r in results["workloads"][key]["systems"] if "error" not in r]
        values = [r["output_tokens_per_s"] for r in rows]
        err = [
            [r["output_tokens_per_s"] - r["output_tokens_per_s_min"] for r in rows],
            [r["output_tokens_per_s_max"] - r["output_tokens_per_s"] for r in rows],
        ]
        ax.barh([r["system"] for r in rows], values, xerr=err, color="tab:blue")
        ax.invert_yaxis()
        wl = results["workloads"][key]
        budget = f", KV budget {wl['kv_budget_bytes'] / (1 << 20):g} MiB" if "kv_budget_bytes" in wl else ""
        ax.set_title(f"{key}: {wl['num_requests']} requests{budget}", fontsize=9)
        ax.set_xlabel("output tokens/s (median, min-max)")
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__, "offline")
    parser.add_argument(
        "--workloads", nargs="+", default=[*WORKLOADS, EQUAL_MEMORY], choices=[*WORKLOADS, EQUAL_MEMORY]
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--static-batch-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument(
        "--pool-mib", type=int, default=1024, help="KV pool of W1-W3 (pagedserve, continuous)"
    )
    parser.add_argument("--kv-budget-mib", type=float, default=512, help="KV budget of every system in W2eq")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="pagedserve's weights and KV cache (transformers' systems stay in float32)",
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        default=list(SYSTEM_KINDS),
        choices=list(SYSTEM_KINDS),
        help="which systems run (make bench-vllm runs pagedserve alone, beside vLLM)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    hf_logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    bench = Bench(args)
    peak = matmul_flops_per_s(bench.device)
    keys = [k for k in [*WORKLOADS, EQUAL_MEMORY] if k in args.workloads]
    systems = {key: [s for s in bench.systems(key) if _kind(s[0]) in args.systems] for key in keys}
    warmup = bench.workload("W1", variant=-1, scale=0.1)
    for key in keys:
        for name, run in systems[key]:
            bench.time_one(key, name, run, warmup, record=False)
    ttft: dict[str, list[float]] = {}
    for rep in range(args.repeats):  # interleaved, so drift on a shared machine hits every system alike
        for key in keys:
            wl = bench.workload(key, variant=2 * rep)
            for name, run in systems[key]:
                bench.time_one(key, name, run, wl)
            if key == "W3":
                fresh = bench.workload(key, variant=2 * rep + 1)
                ttft.setdefault("prefix caching", []).extend(
                    paged_ttft(bench.llms["main"].engine, fresh, f"{rep}")
                )
                ttft.setdefault("no prefix caching", []).extend(
                    paged_ttft(bench.llms["no-prefix"].engine, fresh, f"{rep}")
                )
    results: dict[str, Any] = {
        "args": vars(args),
        "machine": {
            "platform": platform.platform(),
            "device": str(bench.device),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "fp32_matmul_flops_per_s": peak,
        },
        "model": {"path": bench.path, **vars_of(bench.shape), "kv_bytes_per_token": bench.bytes_per_token},
        "flops_formula": FLOPS_FORMULA,
        "mfu_formula": "achieved FLOP/s (flops_formula / median seconds) / fp32_matmul_flops_per_s"
        " (best of 5 timed 2048x2048 torch.mm in this run)",
        "workloads": {},
    }
    for key in keys:
        wl = bench.workload(key, 0)
        names = [name for name, _ in systems[key]]
        names += [n for k, n in bench.errors if k == key and n not in names and _kind(n) in args.systems]
        entry = summarize(bench, key, names, bench.shape.flops(wl), wl, peak)
        if key == EQUAL_MEMORY:
            entry["kv_budget_bytes"] = bench.budget_bytes
        if key == "W3":
            entry["ttft"] = {
                name: {"mean_s": sum(t) / len(t), "p50_s": percentile(t, 50), "p99_s": percentile(t, 99)}
                for name, t in ttft.items()
            }
        results["workloads"][key] = entry
    print(
        f"{bench.path}: {bench.shape.num_params_without_embeddings / 1e6:.1f}M non-embedding parameters, "
        f"{bench.device}, {torch.get_num_threads()} threads, fp32 matmul {peak / 1e9:.1f} GFLOP/s, "
        f"median of {args.repeats}, scale {args.scale:g}"
    )
    print_table(results)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(results, Path(args.plot))
    print(f"wrote {out} and {args.plot}")
    return results


def _kind(name: str) -> str:
    return next(kind for kind, start in SYSTEM_KINDS.items() if name.startswith(start))


def vars_of(shape: ModelShape) -> dict[str, int]:
    return {f: getattr(shape, f) for f in shape.__slots__}


if __name__ == "__main__":
    main()
