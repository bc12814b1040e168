"""What holding tool calls to their schemas costs: the time to a call's first argument token and the decode
speed of constrained calls, against free text from the same prompt.

    .venv/bin/python benchmarks/tool_calls.py                         # SmolLM2, batch 1 and 4, 3 repeats
    .venv/bin/python benchmarks/tool_calls.py --smoke --model <folder>  # a few seconds on a small model

The prompt is a chat whose system message shows two tools in pagedserve's tool-call format, as the gateway
writes it (gateway.serving.tools). Two modes, paired in each repeat on one engine (prefix caching off):
`free`, no grammar and exactly --output-len tokens (min_tokens = max_tokens, greedy), and `call`, the grammar
of `tool_choice: required` with one call (greedy, to the end of the call, at most --output-len tokens). Per
request: the time to its first token, the time to its first argument token (the first token after
`"arguments": `; for free text, its first token), the decode time per token after it, and output tokens/s.
Medians over the repeats and the batch's requests. Prints a table; writes JSON and a PNG plot.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from workloads import benchmark_parser, median, save_figure

from gateway.serving.tokenization import Tokenizer
from gateway.serving.tools import Tool, grammar, tools_section
from gpu_worker import LLMEngine, SamplingParams
from gpu_worker.engine.config import EngineConfig
from shared.sampling import StructuredSpec

TOOLS = [
    Tool(
        "get_weather",
        "The current weather in a city",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    ),
    Tool(
        "get_forecast",
        "The forecast for the coming days",
        {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    ),
]
QUESTION = "What is the weather like in Paris today, in celsius?"
ARGUMENTS_MARK = '"arguments": '
MODES = ("free", "call")


def prompt_ids(tokenizer: Tokenizer) -> list[int]:
    turns = [
        {"role": "system", "content": f"You are a helpful assistant.\n\n{tools_section(TOOLS)}"},
        {"role": "user", "content": QUESTION},
    ]
    return tokenizer.encode_chat(turns)


def first_argument_token(tokenizer: Tokenizer, ids: list[int]) -> int:
    """The index of the first output token that writes the call's arguments (after `"arguments": `)."""
    text = tokenizer.decode(ids)
    mark = text.find(ARGUMENTS_MARK)
    assert mark >= 0, text
    start = mark + len(ARGUMENTS_MARK)
    for k in range(len(ids)):
        if len(tokenizer.decode(ids[: k + 1])) > start:
            return k
    raise AssertionError(text)


def run(
    engine: LLMEngine,
    tokenizer: Tokenizer,
    prompt: list[int],
    batch: int,
    mode: str,
    tag: str,
    output_len: int,
) -> list[dict[str, float]]:
    """One batch of the same request; each request's figures."""
    if mode == "free":
        params = SamplingParams(
            temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True
        )
    else:
        spec = StructuredSpec(kind="grammar", value=grammar(TOOLS, "required", parallel=False))
        params = SamplingParams(temperature=0.0, max_tokens=output_len, structured=spec)
    ids = [f"{tag}-{i}" for i in range(batch)]
    start = time.perf_counter()
    for request_id in ids:
        engine.add_request(request_id, prompt, params)
    owner = {id(seq): rid for rid in ids for seq in engine.requests[rid]}
    arrivals: dict[str, list[float]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        seqs = engine.step()
        now = time.perf_counter() - start
        for seq in seqs:
            times = arrivals[owner[id(seq)]]
            times.extend([now] * (seq.num_output_tokens - len(times)))
    figures = []
    for request_id in ids:
        [seq] = engine.release(request_id)
        out = seq.output_token_ids
        times = arrivals[request_id]
        k = 0 if mode == "free" else first_argument_token(tokenizer, out)
        after = len(out) - k - 1
        figures.append(
            {
                "output_tokens": len(out),
                "ttft_s": times[0],
                "first_argument_s": times[k],
                "ms_per_token_after": 1000 * (times[-1] - times[k]) / after if after > 0 else 0.0,
                "output_tokens_per_s": len(out) / times[-1],
            }
        )
    return figures


FIELDS = ("ttft_s", "first_argument_s", "ms_per_token_after", "output_tokens_per_s", "output_tokens")


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.5))
    batches = results["batches"]
    x = range(len(batches))
    for offset, mode in ((-0.2, "free"), (0.2, "call")):
        rows = [results["median"][f"{mode}@{b}"] for b in batches]
        left.bar([i + offset for i in x], [1000 * r["first_argument_s"] for r in rows], 0.4, label=mode)
        right.bar([i + offset for i in x], [r["ms_per_token_after"] for r in rows], 0.4, label=mode)
    left.set_title("to the first argument token (free: first token), ms")
    right.set_title("decode, ms per token after it")
    for ax in (left, right):
        ax.set_xticks(list(x), [f"batch {b}" for b in batches])
        ax.legend()
    fig.suptitle("tool calls held by the grammar (tool_choice required) against free text")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = benchmark_parser(__doc__, "tool_calls")
    parser.add_argument("--batches", default="1,4", help="comma-separated batch sizes")
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="batch 1, 1 repeat, short (for tests)")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.smoke:
        batches, args.repeats, args.output_len = [1], 1, 24
    engine = LLMEngine(args.model, EngineConfig(enable_prefix_caching=False), device="cpu")
    tokenizer = Tokenizer(args.model)
    prompt = prompt_ids(tokenizer)
    run(engine, tokenizer, prompt, 1, "call", "warm-up", args.output_len)
    per: dict[str, list[dict[str, float]]] = {f"{m}@{b}": [] for b in batches for m in MODES}
    for r in range(args.repeats):
        for b in batches:
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                per[f"{mode}@{b}"] += run(
                    engine, tokenizer, prompt, b, mode, f"{r}-{b}-{mode}", args.output_len
                )
    summary = {key: {f: median([row[f] for row in rows]) for f in FIELDS} for key, rows in per.items()}
    results: dict[str, Any] = {
        "args": vars(args),
        "batches": batches,
        "prompt_tokens": len(prompt),
        "median": summary,
        "runs": per,
    }
    print(f"prompt {len(prompt)} tokens; medians of {args.repeats} repeats")
    print("| batch | mode | first token ms | first argument ms | ms/token after | output tok/s | tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for b in batches:
        for mode in MODES:
            s = summary[f"{mode}@{b}"]
            print(
                f"| {b} | {mode} | {1000 * s['ttft_s']:.0f} | {1000 * s['first_argument_s']:.0f} | "
                f"{s['ms_per_token_after']:.1f} | {s['output_tokens_per_s']:.1f} | {s['output_tokens']:.0f} |"
            )
    for b in batches:
        free, call = summary[f"free@{b}"], summary[f"call@{b}"]
        ratio = results[f"decode_ratio@{b}"] = call["ms_per_token_after"] / free["ms_per_token_after"]
        later_ms = 1000 * (call["first_argument_s"] - free["ttft_s"])
        print(
            f"batch {b}: a constrained call's decode step costs {ratio:.2f}x a free one; its first argument "
            f"token comes {later_ms:.0f} ms after free text's first token"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    plot(results, Path(args.plot))
    return results


if __name__ == "__main__":
    main()
