"""Serving: the gateway (openai client, SSE) against the engine in-process, on the same arrivals and prompts.

    .venv/bin/python benchmarks/serving.py                     # starts the services itself, default model
    .venv/bin/python benchmarks/serving.py --url http://127.0.0.1:8000           # services already running
    .venv/bin/python benchmarks/serving.py --num-prompts 8 --request-rates 2 inf --max-tokens 16  # quick look

Scenarios: Poisson arrivals at each of --request-rates (seeded exponential gaps; inf: all at once) and a fixed
--concurrency. Each has its own random-token prompts (--input-len MIN MAX, fixed seed) of --max-tokens output
tokens, greedy, ignore_eos; both paths replay the same arrival times and prompts. Gateway: the openai client
streams each request (stream=True, include_usage), one thread per request in flight. Without --url, the
script runs scripts/run.sh in a process group of its own (Redis only if none answers at REDIS_URL, the
scheduler, one worker, the gateway on a free port, a Redis prefix of its own), then stops the group and
deletes the keys left under that prefix. Offline: LLMEngine in this process with the worker's EngineConfig
(the same settings from the environment), run after the services of its own have stopped, its pool pinned to
the worker's block count (with --url: while the services sit idle); a request is added at the first step
boundary after its arrival, and when nothing runs the loop sleeps until the next arrival.

TTFT: first token - sent (offline: from the scheduled arrival, so the wait for the step in progress counts, as
it does at the worker). ITL: time between consecutive chunks with text (gateway: a chunk may carry several
tokens, and a token with no text of its own yet brings none) or consecutive steps that gave the request a
token (offline). TPOT: (E2E - TTFT) / (output tokens - 1). E2E: to the end of the stream, or to the step
that finished the request. Output tokens come from `usage` and must equal --max-tokens. Throughput is over
the scenario (its start to the last finish); below capacity it follows the arrival rate, so the throughput
target speaks at inf and at fixed concurrency. Targets: the services add at most 2 ms to p99 ITL and keep at
least 95% of the in-process output tok/s. Prints a table; writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import random
import statistics
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import openai
import torch
from services import Services, worker_blocks
from transformers import AutoConfig
from workloads import FIRST_TOKEN_ID, percentile, save_figure

from gpu_worker import LLMEngine, SamplingParams
from gpu_worker.engine.model_loader import resolve_model_path
from gpu_worker.settings import WorkerSettings, engine_config

TARGETS = {"itl_p99_added_ms": 2.0, "output_throughput_ratio": 0.95}


@dataclasses.dataclass(slots=True)
class Scenario:
    """When each request goes out: seconds from the start, and at most max_concurrency in flight."""

    name: str
    arrivals: list[float]
    max_concurrency: int | None = None


@dataclasses.dataclass(slots=True)
class RequestResult:
    """One request's timings in seconds: sent from the scenario's start, the rest from sent."""

    sent: float = 0.0
    ttft: float = 0.0
    itls: list[float] = dataclasses.field(default_factory=list)
    e2e: float = 0.0
    num_tokens: int = 0
    num_chunks: int = 0
    error: str | None = None


def timed(sent: float, times: list[float], end: float, num_tokens: int, max_tokens: int) -> RequestResult:
    """A request from the times its tokens (chunks) came, all from the scenario's start."""
    error = None if times and num_tokens == max_tokens else f"{num_tokens} tokens, expected {max_tokens}"
    itls = [b - a for a, b in itertools.pairwise(times)]
    return RequestResult(
        sent, times[0] - sent if times else 0.0, itls, end - sent, num_tokens, len(times), error
    )


def make_scenarios(num: int, rates: list[float], concurrency: int, seed: int) -> list[Scenario]:
    rng = random.Random(seed)
    scenarios = []
    for rate in rates:
        gaps = [0.0 if math.isinf(rate) else rng.expovariate(rate) for _ in range(num - 1)]
        name = "rate inf" if math.isinf(rate) else f"rate {rate:g}/s"
        scenarios.append(Scenario(name, [0.0, *itertools.accumulate(gaps)]))
    if concurrency:
        scenarios.append(Scenario(f"concurrency {concurrency}", [0.0] * num, concurrency))
    return scenarios


def make_prompts(num: int, vocab: int, input_len: tuple[int, int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(input_len[0], input_len[1] + 1, (num,), generator=g).tolist()
    return [torch.randint(FIRST_TOKEN_ID, vocab, (n,), generator=g).tolist() for n in lengths]


def run_gateway(
    client: openai.OpenAI, model: str, prompts: list[list[int]], scenario: Scenario, max_tokens: int
) -> list[RequestResult]:
    results = [RequestResult() for _ in prompts]
    slots = threading.Semaphore(scenario.max_concurrency or len(prompts))
    start = time.perf_counter()

    def one(i: int) -> None:
        sent, times, num_tokens = time.perf_counter() - start, [], 0
        try:
            stream = client.completions.create(
                model=model,
                prompt=prompts[i],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    times.append(time.perf_counter() - start)
                if chunk.usage is not None:
                    num_tokens = chunk.usage.completion_tokens
            results[i] = timed(sent, times, time.perf_counter() - start, num_tokens, max_tokens)
        except Exception as e:  # recorded and counted; the other requests go on
            results[i] = RequestResult(sent, error=f"{type(e).__name__}: {e}")
        finally:
            slots.release()

    threads = []
    for i, arrival in enumerate(scenario.arrivals):
        time.sleep(max(0.0, start + arrival - time.perf_counter()))
        slots.acquire()
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join()
    return results


def run_offline(
    engine: LLMEngine, prompts: list[list[int]], scenario: Scenario, max_tokens: int
) -> list[RequestResult]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tag, results = uuid.uuid4().hex[:8], [RequestResult() for _ in prompts]
    sent, times = [0.0] * len(prompts), [list[float]() for _ in prompts]
    pending, running = deque(range(len(prompts))), dict[str, int]()  # engine request id -> prompt index
    limit = scenario.max_concurrency or len(prompts)
    start = time.perf_counter()
    while pending or running:
        now = time.perf_counter() - start
        while pending and scenario.arrivals[pending[0]] <= now and len(running) < limit:
            i = pending.popleft()
            running[f"{tag}-{i}"] = i
            engine.add_request(f"{tag}-{i}", prompts[i], params)
            sent[i] = now if scenario.max_concurrency else scenario.arrivals[i]
        if not running:
            time.sleep(max(0.0, scenario.arrivals[pending[0]] - now))
            continue
        seqs = engine.step()
        now = time.perf_counter() - start
        for seq in seqs:
            i = running[seq.request_id]
            times[i].append(now)
            if seq.is_finished:
                del running[seq.request_id]
                engine.release(seq.request_id)
                results[i] = timed(sent[i], times[i], now, seq.num_output_tokens, max_tokens)
    return results


def stats(values: list[float]) -> dict[str, float]:
    ms = [1000 * v for v in values] or [math.nan]
    return {f"p{q}": percentile(ms, q) for q in (50, 90, 99)} | {"mean": statistics.fmean(ms)}


def summarize(results: list[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    if not ok:
        raise RuntimeError(f"every request failed: {results[0].error}")
    duration, tokens = max(r.sent + r.e2e for r in ok), sum(r.num_tokens for r in ok)
    return {
        "num_requests": len(results),
        "num_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "num_output_tokens": tokens,
        "tokens_per_chunk": tokens / sum(r.num_chunks for r in ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": tokens / duration,
        "ttft_ms": stats([r.ttft for r in ok]),
        "tpot_ms": stats([(r.e2e - r.ttft) / (r.num_tokens - 1) for r in ok if r.num_tokens > 1]),
        "itl_ms": stats([itl for r in ok for itl in r.itls]),
        "e2e_ms": stats([r.e2e for r in ok]),
    }


def compare(scenario: Scenario, gateway: list[RequestResult], offline: list[RequestResult]) -> dict[str, Any]:
    """One scenario's row: both paths' figures, and what the services cost against the targets."""
    gw, off = summarize(gateway), summarize(offline)
    added = gw["itl_ms"]["p99"] - off["itl_ms"]["p99"]
    ratio = gw["output_throughput"] / off["output_throughput"]
    overhead = {"itl_p99_added_ms": added, "output_throughput_ratio": ratio}
    met = {"itl_target_met": added <= TARGETS["itl_p99_added_ms"]}
    met["throughput_target_met"] = ratio >= TARGETS["output_throughput_ratio"]
    return {"scenario": scenario.name, "gateway": gw, "offline": off, "overhead": overhead | met}


def print_table(rows: list[dict[str, Any]]) -> None:
    def ms(s: dict[str, float], *qs: str) -> str:
        return "/".join(f"{s[q]:.1f}" for q in qs)

    head = "TTFT p50/90/99 ms | TPOT p50/99 | ITL p50/90/99 | E2E p50/99"
    print(f"{'scenario':16} {'path':8} {'req/s':>6} {'tok/s':>7} fail  {head}")
    for row, path in itertools.product(rows, ("gateway", "offline")):
        r = row[path]
        latency = [ms(r["ttft_ms"], "p50", "p90", "p99"), ms(r["tpot_ms"], "p50", "p99")]
        latency += [ms(r["itl_ms"], "p50", "p90", "p99"), ms(r["e2e_ms"], "p50", "p99")]
        print(
            f"{row['scenario']:16} {path:8} {r['request_throughput']:6.2f} {r['output_throughput']:7.1f} "
            f"{r['num_failed']:4d}  {' | '.join(latency)}"
        )
    verdict = {True: "met", False: "MISSED"}
    for row in rows:
        o = row["overhead"]
        print(
            f"{row['scenario']:16} p99 ITL {o['itl_p99_added_ms']:+.2f} ms (target <= 2: "
            f"{verdict[o['itl_target_met']]}); output tok/s {o['output_throughput_ratio']:.3f}x in-process "
            f"(target >= 0.95: {verdict[o['throughput_target_met']]})"
        )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(rows)))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, (metric, label) in zip(axes, (("ttft_ms", "TTFT (ms)"), ("itl_ms", "inter-token latency (ms)"))):
        for (color, name), (q, style) in itertools.product(
            (("C0", "gateway"), ("C1", "offline")), (("p50", "o-"), ("p99", "^--"))
        ):
            ax.plot(x, [r[name][metric][q] for r in rows], style, color=color, label=f"{name} {q}")
        ax.set_ylabel(label)
    axes[0].set_yscale("log")
    for offset, color, name in ((-0.2, "C0", "gateway"), (0.2, "C1", "offline")):
        throughput = [r[name]["output_throughput"] for r in rows]
        axes[2].bar([i + offset for i in x], throughput, 0.4, color=color, label=name)
    axes[2].set_ylabel("output tokens/s")
    for ax in axes:
        ax.set_xticks(x, [r["scenario"] for r in rows], rotation=20)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default=None, help="services already running there (default: start them)")
    parser.add_argument("--model", default=None, help="model folder or GGUF file (default: SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per scenario")
    parser.add_argument("--request-rates", type=float, nargs="+", default=[1.0, 2.0, 4.0, math.inf])
    parser.add_argument("--concurrency", type=int, default=8, help="the fixed-concurrency scenario; 0: none")
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (at least 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="benchmarks/results/serving.json")
    parser.add_argument("--plot", default="benchmarks/results/serving.png")
    args = parser.parse_args(argv)
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2 (one token has no inter-token latency)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    settings = WorkerSettings(**({"model": args.model} if args.model else {}))
    vocab = AutoConfig.from_pretrained(resolve_model_path(settings.model)).vocab_size
    scenarios = make_scenarios(args.num_prompts, args.request_rates, args.concurrency, args.seed)
    prompts = [
        make_prompts(args.num_prompts, vocab, args.input_len, args.seed * 1000 + k + 1)
        for k in range(len(scenarios))
    ]
    warm_up, warm_prompts = Scenario("warm-up", [0.0, 0.0]), make_prompts(2, vocab, (8, 8), 999_999)
    gateway: list[list[RequestResult]] = []
    services: Services | None = None
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            services = stack.enter_context(Services(settings, Path(args.json).with_suffix(".log")))
            url = services.url
        key = os.environ.get("API_KEY", "unused")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=3600)
        served = client.models.list().data[0].id
        run_gateway(client, served, warm_prompts, warm_up, 4)
        for scenario, p in zip(scenarios, prompts):
            gateway.append(run_gateway(client, served, p, scenario, args.max_tokens))
            print(f"gateway: {scenario.name} done", flush=True)
        blocks = worker_blocks(settings.redis_url, services.keys if services else settings.keys)
    # Services of our own have stopped here, so the engine can take a pool the worker's size.
    config = engine_config(settings, **({"num_kv_blocks": blocks} if services else {}))
    engine = LLMEngine(settings.model, config, dtype=settings.dtype, device=settings.device)
    run_offline(engine, warm_prompts, warm_up, 4)
    rows = [
        compare(s, g, run_offline(engine, p, s, args.max_tokens))
        for s, g, p in zip(scenarios, gateway, prompts)
    ]
    results = {
        "args": vars(args) | {"request_rates": [f"{r:g}" for r in args.request_rates]},  # no Infinity in JSON
        "model": resolve_model_path(settings.model),
        "device": str(engine.device),
        "url": url,
        "engine_config": config.model_dump(),
        "num_kv_blocks": {"worker": blocks, "offline": engine.allocator.num_blocks},
        "redis_prefix": services.keys.prefix if services else None,
        "redis_keys_left_by_services": services.keys_left if services else None,
        "arrivals_s": {s.name: s.arrivals for s in scenarios},
        "targets": TARGETS,
        "scenarios": rows,
    }
    print_table(rows)
    if services and services.keys_left:
        print(f"keys the services left under their prefix (deleted): {services.keys_left}")
    out, png = Path(args.json), Path(args.plot)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(rows, png)
    print(f"wrote {out} and {png}")
    return results


if __name__ == "__main__":
    main()
