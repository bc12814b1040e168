"""Speculative decoding by n-gram prompt lookup: what it gains where the output repeats the input, what it
costs where it does not, and W2 with it on.

    .venv/bin/python benchmarks/speculative.py                          # SmolLM2, batch 1 and 4, 3 repeats
    .venv/bin/python benchmarks/speculative.py --smoke --model <folder>  # a few seconds on a small model

Two workloads of chat requests, greedy, each to its end (EOS) or --max-tokens: `grounded`, answers that
repeat their input (rewrite a passage with one change, quote a paragraph, edit a code file and give it back
whole), and `free`, open questions whose answers the prompt does not hold. Batch b runs the workload's first
b requests together. Two engines in one process, the same but for --speculative-config, paired in every
repeat (their order alternating); prefix caching off, so no repeat is faster for an earlier one. Per batch:
output tokens/s (tokens over wall time), ITL p50 and p99 (the gaps between a request's deliveries: a step
that accepts drafts delivers several tokens at once, as it streams them), the acceptance rate (accepted
drafts over drafts verified), and tokens per step (what each step of a request delivered, on average). The
outputs of both engines are compared token for token. Then W2 (benchmarks/workloads.py) through
LLM.generate with speculation off and on, paired: at its batch sizes speculation is switched off, so the
ratio says what the feature costs when it does not run. Prints a table; writes JSON and a PNG plot.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from workloads import benchmark_parser, make_workload, median, percentile, save_figure, write_json

from gateway.serving.tokenization import Tokenizer
from gpu_worker import LLM, LLMEngine, SamplingParams
from gpu_worker.engine.config import EngineConfig

PASSAGE = (
    "The river rises in the mountains, gathers snowmelt through the spring, and winds past farms, mills and "
    "old stone bridges before it reaches the sea. Towns grew where it could be crossed, and trade followed."
)
CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def describe(item):
    return f"{item.name}: {item.quantity} at {item.price}"
"""
WORKLOADS: dict[str, list[str]] = {
    "grounded": [
        f"Rewrite this passage, word for word, but with 'river' replaced by 'stream':\n\n{PASSAGE}",
        f"Rename total_price to order_total in this file and give back the whole file:\n\n{CODE}",
        f"Quote this paragraph exactly, then say in one line what it is about:\n\n{PASSAGE}",
        f"Add a docstring to each function of this file and give back the whole file:\n\n{CODE}",
    ],
    "free": [
        "Write a short story about a lighthouse keeper.",
        "Explain how a bicycle stays upright.",
        "Give me ideas for a rainy weekend.",
        "Describe the life cycle of a star.",
    ],
}
MODES = ("off", "on")
DEFAULT_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
HEADER = (
    "| workload | batch | speculation | output tok/s | ratio "
    "| ITL p50 ms | ITL p99 ms | acceptance | tok/step |"
)


def run(engine: LLMEngine, prompts: list[list[int]], tag: str, max_tokens: int) -> dict[str, Any]:
    """One batch: its wall time, tokens, delivery gaps, steps per request and output."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    speculator = engine.step_scheduler.speculator
    before = (
        (speculator.stats.num_draft_tokens, speculator.stats.num_accepted_tokens) if speculator else (0, 0)
    )
    start = time.perf_counter()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    owner = {id(seq): rid for rid in ids for seq in engine.requests[rid]}
    deliveries: dict[str, list[float]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        seqs = engine.step()
        now = time.perf_counter()
        for seq in seqs:
            deliveries[owner[id(seq)]].append(now)
    wall = time.perf_counter() - start
    outputs = [engine.release(rid)[0].output_token_ids for rid in ids]
    gaps = [b - a for rid in ids for a, b in zip(deliveries[rid], deliveries[rid][1:])]
    after = (
        (speculator.stats.num_draft_tokens, speculator.stats.num_accepted_tokens) if speculator else (0, 0)
    )
    tokens = sum(map(len, outputs))
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "itl_ms": [1000 * g for g in gaps],
        "tokens_per_step": tokens / sum(len(d) for d in deliveries.values()),
        "draft_tokens": after[0] - before[0],
        "accepted_tokens": after[1] - before[1],
        "outputs": outputs,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    itl = [g for r in runs for g in r["itl_ms"]]
    drafts = sum(r["draft_tokens"] for r in runs)
    return {
        "output_tokens_per_s": median([r["output_tokens_per_s"] for r in runs]),
        "itl_p50_ms": percentile(itl, 50) if itl else 0.0,
        "itl_p99_ms": percentile(itl, 99) if itl else 0.0,
        "acceptance": sum(r["accepted_tokens"] for r in runs) / drafts if drafts else 0.0,
        "tokens_per_step": median([r["tokens_per_step"] for r in runs]),
        "output_tokens": median([r["output_tokens"] for r in runs]),
    }


def w2_ratio(args: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """W2 through LLM.generate, speculation off and on, paired over the repeats: tokens/s of each."""
    llms = {
        "off": LLM(args.model, device="cpu", enable_prefix_caching=False),
        "on": LLM(args.model, device="cpu", enable_prefix_caching=False, speculative_config=spec),
    }
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.w2_repeats):
        wl = make_workload("W2", llms["off"].engine.vocab_size, args.w2_scale, args.seed, variant=r)
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
            start = time.perf_counter()
            llms[mode].generate(wl.prompts, params, use_tqdm=False)
            rates[mode].append(wl.num_output_tokens / (time.perf_counter() - start))
    off, on = median(rates["off"]), median(rates["on"])
    return {"tokens_per_s": {"off": off, "on": on}, "ratio": on / off, "runs": rates, "scale": args.w2_scale}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    keys = [f"{w}@{b}" for w in WORKLOADS for b in results["batches"]]
    x = range(len(keys))
    for offset, mode in ((-0.2, "off"), (0.2, "on")):
        rows = [results["median"][f"{key}/{mode}"] for key in keys]
        left.bar(
            [i + offset for i in x],
            [r["output_tokens_per_s"] for r in rows],
            0.4,
            label=f"speculation {mode}",
        )
        right.bar([i + offset for i in x], [r["itl_p50_ms"] for r in rows], 0.4, label=f"speculation {mode}")
    left.set_title("output tokens/s")
    right.set_title("ITL p50, ms (gap between deliveries)")
    for ax in (left, right):
        ax.set_xticks(list(x), [k.replace("@", "\nbatch ") for k in keys])
        ax.legend()
    fig.suptitle(f"n-gram speculative decoding ({results['speculative_config']})")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = benchmark_parser(__doc__, "speculative")
    parser.add_argument("--batches", default="1,4", help="comma-separated batch sizes (at most 4)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--speculative-config",
        default=json.dumps(DEFAULT_SPEC),
    )
    parser.add_argument("--w2-scale", type=float, default=0.5, help="W2's scale (0: skip W2)")
    parser.add_argument("--w2-repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="batch 1, 1 repeat, short, no W2 (for tests)")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.smoke:
        batches, args.repeats, args.max_tokens, args.w2_scale = [1], 1, 16, 0.0
    spec = json.loads(args.speculative_config)
    engines = {
        "off": LLMEngine(args.model, EngineConfig(enable_prefix_caching=False), device="cpu"),
        "on": LLMEngine(
            args.model, EngineConfig(enable_prefix_caching=False, speculative_config=spec), device="cpu"
        ),
    }
    tokenizer = Tokenizer(args.model)
    prompts = {
        w: [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in texts]
        for w, texts in WORKLOADS.items()
    }
    for mode in MODES:
        run(engines[mode], prompts["free"][:1], f"warm-up-{mode}", 8)
    per: dict[str, list[dict[str, Any]]] = {
        f"{w}@{b}/{m}": [] for w in WORKLOADS for b in batches for m in MODES
    }
    identical = True
    for r in range(args.repeats):
        for w in WORKLOADS:
            for b in batches:
                got = {}
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    result = run(engines[mode], prompts[w][:b], f"{r}-{w}-{b}-{mode}", args.max_tokens)
                    per[f"{w}@{b}/{mode}"].append(result)
                    got[mode] = result["outputs"]
                identical &= got["off"] == got["on"]
    summary = {key: summarize(rows) for key, rows in per.items()}
    results: dict[str, Any] = {
        "args": vars(args),
        "speculative_config": spec,
        "batches": batches,
        "median": summary,
        "identical_outputs": identical,
        "runs": {
            k: [{f: v for f, v in row.items() if f != "outputs"} for row in rows] for k, rows in per.items()
        },
    }
    print(f"speculative_config {spec}; medians of {args.repeats} repeats; outputs identical: {identical}")
    print(HEADER)
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for w in WORKLOADS:
        for b in batches:
            base = summary[f"{w}@{b}/off"]["output_tokens_per_s"]
            for mode in MODES:
                s = summary[f"{w}@{b}/{mode}"]
                ratio = s["output_tokens_per_s"] / base
                results.setdefault("ratio", {})[f"{w}@{b}"] = ratio
                acceptance = f"{s['acceptance']:.2f}" if mode == "on" else ""
                itl = f"{s['itl_p50_ms']:.1f} | {s['itl_p99_ms']:.1f}"
                print(
                    f"| {w} | {b} | {mode} | {s['output_tokens_per_s']:.1f} | {ratio:.2f}x | {itl} | "
                    f"{acceptance} | {s['tokens_per_step']:.2f} |"
                )
    if args.w2_scale > 0:
        results["w2"] = w2 = w2_ratio(args, spec)
        rates = w2["tokens_per_s"]
        print(
            f"W2 (scale {args.w2_scale}, {args.w2_repeats} repeats): {rates['off']:.0f} tok/s off, "
            f"{rates['on']:.0f} on: {w2['ratio']:.3f}x"
        )
    write_json(results, args.json)
    plot(results, Path(args.plot))
    return results


if __name__ == "__main__":
    main()
