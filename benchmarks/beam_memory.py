"""KV blocks that beam search saves by sharing: distinct physical blocks against one copy per beam.

    .venv/bin/python benchmarks/beam_memory.py             # widths 4 and 8, 3 prompts, 64 and 128 tokens
    .venv/bin/python benchmarks/beam_memory.py --widths 2 4 6 --max-tokens 96

Drives LLMEngine directly, one beam-search request at a time (ignore_eos, so every search runs to max_tokens).
After every step it counts the distinct blocks in use (beams fork from their parent and share every block up
to where they diverge; a block is copied only when a beam writes into a shared one) and what the same live
beams would hold each with its own copy (the sum of their block-table lengths). Saved = 1 - distinct / copies,
per step, then averaged over the steps of a run. The vLLM paper (Kwon et al., SOSP 2023, section 6.3) reports
37.6-55.2% saved for beam search. Prints a table; writes JSON and a PNG plot.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoTokenizer
from workloads import benchmark_parser, save_figure

from gpu_worker import LLMEngine, SamplingParams
from gpu_worker.engine.config import EngineConfig
from gpu_worker.engine.model_loader import resolve_model_path

PAPER_SAVED = (0.376, 0.552)
ARTICLE = (
    "The river rises in the mountains, gathers snowmelt through the spring, and winds past farms, mills and "
    "old stone bridges before it reaches the sea. Towns grew where it could be crossed, and trade followed. "
)
MESSAGES = {
    "question": "What is the capital of France?",
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "summary": "Summarize this text: " + ARTICLE * 4,
}


def chat_prompts(tokenizer: Any, names: list[str]) -> dict[str, list[int]]:
    prompts = {}
    for name in names:
        encoded: Any = tokenizer.apply_chat_template(
            [{"role": "user", "content": MESSAGES[name]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )
        prompts[name] = list(encoded["input_ids"])
    return prompts


def trace(engine: LLMEngine, prompt: list[int], width: int, max_tokens: int) -> list[dict[str, Any]]:
    """One sample after every step of one beam search, while its beams are live."""
    params = SamplingParams(
        n=width, best_of=width, use_beam_search=True, temperature=0.0, max_tokens=max_tokens, ignore_eos=True
    )
    engine.add_request("beam", prompt, params)
    samples = []
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        search = engine.beam_searches.get("beam")
        if search is None:
            continue
        distinct = engine.allocator.num_used_blocks
        copies = sum(len(seq.block_table) for seq in search.live)
        samples.append(
            {
                "step": step,
                "num_live_beams": len(search.live),
                "num_distinct_blocks": distinct,
                "num_blocks_unshared": copies,
                "saved": 1 - distinct / copies if copies else 0.0,
            }
        )
    engine.release("beam")
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    return samples


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.axhspan(*(100 * s for s in PAPER_SAVED), color="0.9", label="vLLM paper, beam search")
    styles = {w: s for w, s in zip(sorted({r["width"] for r in runs}), ["-", "--", ":", "-."] * 4)}
    for run in runs:
        ax.plot(
            [s["step"] for s in run["samples"]],
            [100 * s["saved"] for s in run["samples"]],
            styles[run["width"]],
            label=f"width {run['width']}, {run['prompt']} ({run['num_prompt_tokens']} + {run['max_tokens']})",
        )
    ax.set_xlabel("decode step")
    ax.set_ylabel("KV blocks saved by sharing (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7, loc="lower right")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = benchmark_parser(__doc__, "beam_memory")
    parser.add_argument("--widths", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--prompts", nargs="+", default=list(MESSAGES), choices=list(MESSAGES))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="one short prompt, 12 tokens (for tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.max_tokens = ["question"], [12]
    path = resolve_model_path(args.model)
    # Room for the widest search of the longest prompt with every beam unshared (what admission asks for).
    prompts = chat_prompts(AutoTokenizer.from_pretrained(path), args.prompts)
    longest = max(map(len, prompts.values())) + max(args.max_tokens)
    num_blocks = max(args.widths) * -(-longest // args.block_size) + 8
    config = EngineConfig(num_kv_blocks=num_blocks, block_size=args.block_size, max_num_seqs=max(args.widths))
    engine = LLMEngine(path, config, dtype="float32")
    runs = []
    for width in args.widths:
        for name, prompt in prompts.items():
            for max_tokens in args.max_tokens:
                start = time.perf_counter()
                samples = trace(engine, prompt, width, max_tokens)
                saved = [s["saved"] for s in samples]
                runs.append(
                    {
                        "width": width,
                        "prompt": name,
                        "num_prompt_tokens": len(prompt),
                        "max_tokens": max_tokens,
                        "seconds": time.perf_counter() - start,
                        "saved_mean": sum(saved) / len(saved),
                        "saved_last": saved[-1],
                        "distinct_blocks_mean": sum(s["num_distinct_blocks"] for s in samples) / len(samples),
                        "unshared_blocks_mean": sum(s["num_blocks_unshared"] for s in samples) / len(samples),
                        "samples": samples,
                    }
                )
    by_width = {
        w: sum(r["saved_mean"] for r in runs if r["width"] == w) / sum(r["width"] == w for r in runs)
        for w in args.widths
    }
    results = {
        "args": vars(args),
        "model": path,
        "device": str(engine.device),
        "num_kv_blocks": num_blocks,
        "paper_saved_range": PAPER_SAVED,
        "notes": {
            "distinct": "blocks with a reference count above zero (one request runs at a time)",
            "unshared": "sum of the live beams' block-table lengths: each beam holding its own copy",
            "saved": "1 - distinct / unshared per step, averaged over the steps of a run",
        },
        "saved_mean_by_width": by_width,
        "runs": runs,
    }
    print(f"beam search KV sharing, block size {args.block_size}, {path}")
    print(
        f"{'width':>5} {'prompt':>9} {'tokens':>10} {'distinct':>9} {'unshared':>9} {'saved':>7} {'last':>7}"
    )
    for r in runs:
        tokens = f"{r['num_prompt_tokens']}+{r['max_tokens']}"
        print(
            f"{r['width']:5d} {r['prompt']:>9} {tokens:>10} {r['distinct_blocks_mean']:9.1f}"
            f" {r['unshared_blocks_mean']:9.1f} {r['saved_mean']:7.1%} {r['saved_last']:7.1%}"
        )
    lo, hi = PAPER_SAVED
    for w, saved in by_width.items():
        print(
            f"width {w}: saved {saved:.1%} of KV blocks on average"
            f" (vLLM paper, beam search: {lo:.1%}-{hi:.1%})"
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(runs, Path(args.plot))
    print(f"wrote {out} and {args.plot}")
    return results


if __name__ == "__main__":
    main()
