"""What structured outputs cost the requests that share a batch with them.

    .venv/bin/python benchmarks/structured.py                # SmolLM2, 32 requests, half with a grammar
    .venv/bin/python benchmarks/structured.py --threads 1    # on a machine whose other core is busy
    .venv/bin/python benchmarks/structured.py --smoke --model <folder>   # a few seconds on a small model

Every request has a random-token prompt of the same length and exactly --output-len output tokens
(min_tokens = max_tokens, greedy), so every run has the same steps and batches. Paired runs on one engine:
`free`, all requests unconstrained, and `mixed`, the same requests with every other one held to an open
grammar (--regex, by default `[^\\n]*`: any line) that never ends a request early. The figure of merit is the
output tokens/s of the unconstrained half, mixed against free (target: at most 5% lower), with the mean step
time, the sampler's share of it and the time outside the forward pass: on a shared CPU the forward pass
varies by several percent from run to run, so the difference outside it is the steadier figure for what the
grammar costs. Each repeat runs both (in alternating order, prefix caching off, fresh
prompts); medians over the repeats. Prints the figures; writes JSON and a PNG plot.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from workloads import FIRST_TOKEN_ID, benchmark_parser, median, save_figure

from gpu_worker import LLMEngine, SamplingParams
from gpu_worker.engine.config import EngineConfig
from gpu_worker.engine.llm_engine import SamplerOutput
from gpu_worker.engine.sampler import Sampler
from gpu_worker.engine.sequence import Sequence
from gpu_worker.engine.step_scheduler import StepSchedule
from shared.sampling import StructuredSpec

# Open: a grammar that can complete (a JSON string's closing quote) would end requests at unequal lengths.
OPEN_REGEX = "[^\n]*"
MODES = ("free", "mixed")


class TimedSampler:
    """The engine's sampler, timed: seconds spent in it over a run."""

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        start = time.perf_counter()
        out = self.inner(logits, seqs)
        self.seconds += time.perf_counter() - start
        return out


class TimedRunner:
    """The engine's step runner, timed: seconds spent in forward passes over a run."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0

    def run(self, out: StepSchedule, sample_rows: list[int]) -> torch.Tensor:
        start = time.perf_counter()
        logits = self.inner.run(out, sample_rows)
        self.seconds += time.perf_counter() - start
        return logits


def prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_TOKEN_ID, vocab_size, (num, length), generator=generator).tolist()


def run(
    engine: LLMEngine, batch: list[list[int]], output_len: int, spec: StructuredSpec | None, tag: str
) -> dict[str, Any]:
    """One run of every prompt; spec (when given) holds every other request. Times its steps and sampler."""
    sampler = TimedSampler(engine.sampler)
    runner = TimedRunner(engine.runner)
    engine.sampler = sampler  # type: ignore[assignment]
    engine.runner = runner
    free = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    held = SamplingParams(
        temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True, structured=spec
    )
    ids = [f"{tag}-{i}" for i in range(len(batch))]
    for i, (request_id, prompt) in enumerate(zip(ids, batch)):
        engine.add_request(request_id, prompt, held if spec is not None and i % 2 else free)
    steps: list[float] = []
    start = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - step_start)
    finally:
        engine.sampler = sampler.inner
        engine.runner = runner.inner
    seconds = time.perf_counter() - start
    for request_id in ids:
        [seq] = engine.release(request_id)
        assert seq.num_output_tokens == output_len, (request_id, seq.num_output_tokens)
    return {
        "seconds": seconds,
        "steps": len(steps),
        "mean_step_ms": 1000 * sum(steps) / len(steps),
        "sampler_ms_per_step": 1000 * sampler.seconds / len(steps),
        "outside_forward_ms_per_step": 1000 * (sum(steps) - runner.seconds) / len(steps),
        # Requests 0, 2, 4, ...: unconstrained in both modes.
        "free_half_output_tokens_per_s": (len(batch) + 1) // 2 * output_len / seconds,
    }


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.5))
    repeats = results["repeats"]
    x = range(len(repeats))
    for offset, mode in ((-0.2, "free"), (0.2, "mixed")):
        left.bar([i + offset for i in x], [r[mode]["free_half_output_tokens_per_s"] for r in repeats], 0.4,
                 label=mode)  # fmt: skip
        right.bar([i + offset for i in x], [r[mode]["mean_step_ms"] for r in repeats], 0.4, label=mode)
    left.set_title("unconstrained half: output tokens/s")
    right.set_title("mean step time (ms)")
    for ax in (left, right):
        ax.set_xlabel("repeat")
        ax.set_xticks(list(x))
        ax.legend()
    fig.suptitle(f"{results['requests']} requests; in 'mixed' every other one follows {results['regex']!r}")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = benchmark_parser(__doc__, "structured")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--regex", default=OPEN_REGEX, help="the grammar; it must never complete")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--smoke", action="store_true", help="8 short requests, 1 repeat (for tests, with a tiny --model)"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.prompt_len, args.output_len, args.repeats = 8, 8, 8, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    # No prefix caching: the paired runs share their prompts.
    engine = LLMEngine(args.model, EngineConfig(enable_prefix_caching=False), device="cpu")
    return measure(engine, args)


def measure(engine: LLMEngine, args: Any) -> dict[str, Any]:
    spec = StructuredSpec(kind="regex", value=args.regex)
    vocab = engine.vocab_size
    run(
        engine,
        prompts(args.requests, args.prompt_len, vocab, args.seed + 999),
        args.output_len,
        spec,
        "warm-up",
    )
    repeats = []
    for r in range(args.repeats):
        batch = prompts(args.requests, args.prompt_len, vocab, args.seed + r)
        order = MODES if r % 2 == 0 else MODES[::-1]
        repeats.append(
            {mode: run(engine, batch, args.output_len, spec if mode == "mixed" else None, f"{r}-{mode}")
             for mode in order}
        )  # fmt: skip
    ratio = [rep["mixed"]["free_half_output_tokens_per_s"] / rep["free"]["free_half_output_tokens_per_s"]
             for rep in repeats]  # fmt: skip
    summary = {
        mode: {
            key: median([rep[mode][key] for rep in repeats])
            for key in (
                "free_half_output_tokens_per_s",
                "mean_step_ms",
                "sampler_ms_per_step",
                "outside_forward_ms_per_step",
            )
        }
        for mode in MODES
    }
    results: dict[str, Any] = {
        "args": vars(args),
        "threads": torch.get_num_threads(),
        "requests": args.requests,
        "regex": args.regex,
        "repeats": repeats,
        "median": summary,
        "mixed_over_free_tokens_per_s": median(ratio),
        "loss": 1 - median(ratio),
        "ratio_per_repeat": ratio,
        # What the grammar adds to a step outside the forward pass, as a share of an all-free step.
        "grammar_overhead": median(
            [
                (rep["mixed"]["outside_forward_ms_per_step"] - rep["free"]["outside_forward_ms_per_step"])
                / rep["free"]["mean_step_ms"]
                for rep in repeats
            ]
        ),
    }
    for mode in MODES:
        s = summary[mode]
        print(
            f"{mode:>5}: unconstrained half {s['free_half_output_tokens_per_s']:.1f} output tok/s, "
            f"step {s['mean_step_ms']:.1f} ms (sampler {s['sampler_ms_per_step']:.2f} ms, "
            f"outside the forward pass {s['outside_forward_ms_per_step']:.2f} ms)"
        )
    print(
        f"{args.requests} requests x {args.output_len} tokens, every other one held to {args.regex!r}: "
        f"the free half runs at {100 * results['mixed_over_free_tokens_per_s']:.1f}% of its all-free speed "
        f"(median of {args.repeats} paired repeats; loss {100 * results['loss']:.1f}%, target <= 5%); "
        f"outside the forward pass the grammar adds {100 * results['grammar_overhead']:.1f}% to a step"
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    plot(results, Path(args.plot))
    return results


if __name__ == "__main__":
    main()
