"""Latency through the gateway against the offline engine, on the same prompts at the same concurrency.

Start the services first (`make run`, default model), then:

    .venv/bin/python benchmarks/serving_latency.py                 # 32 requests, 8 at a time, 64 tokens each

Each request is a random-token prompt (fixed seed, 32-128 tokens), greedy, ignore_eos. Through the gateway
the official openai client streams it (SSE); offline, the same prompts go through LLMEngine in this process
with the same number in flight. Prints time to first token (TTFT) and inter-token latency (ITL) at p50 and
p99, and output tokens/s, for both; writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import openai
import torch

from gpu_worker import EngineConfig, LLMEngine, SamplingParams


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def make_prompts(num: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 129, (num,), generator=g).tolist()
    return [torch.randint(17, vocab, (n,), generator=g).tolist() for n in lengths]


def through_gateway(
    url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> dict[str, Any]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=os.environ.get("API_KEY", "unused"), max_retries=0)
    ttft: list[float] = []
    itl: list[float] = []
    lock = threading.Lock()

    def one(prompt: list[int]) -> None:
        start = time.perf_counter()
        times: list[float] = []
        stream = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
        with lock:
            ttft.append(times[0] - start)
            itl.extend(b - a for a, b in itertools.pairwise(times))

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, prompts))
    elapsed = time.perf_counter() - start
    return summarize(ttft, itl, len(prompts) * max_tokens, elapsed)


def offline(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ttft: list[float] = []
    itl: list[float] = []
    pending = [(f"bench-{i}", prompt) for i, prompt in enumerate(prompts)]
    in_flight: set[str] = set()
    started: dict[str, float] = {}
    last: dict[str, float] = {}
    start = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            rid, prompt = pending.pop(0)
            engine.add_request(rid, prompt, params)
            started[rid] = time.perf_counter()
            in_flight.add(rid)
        seqs = engine.step()
        now = time.perf_counter()
        for seq in seqs:
            rid = seq.request_id
            if rid in last:
                itl.append(now - last[rid])
            else:
                ttft.append(now - started[rid])
            last[rid] = now
            if seq.is_finished:
                in_flight.discard(rid)
                engine.release(rid)
    elapsed = time.perf_counter() - start
    return summarize(ttft, itl, len(prompts) * max_tokens, elapsed)


def summarize(ttft: list[float], itl: list[float], tokens: int, elapsed: float) -> dict[str, Any]:
    return {
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p99_ms": 1000 * percentile(ttft, 99),
        "itl_p50_ms": 1000 * percentile(itl, 50),
        "itl_p99_ms": 1000 * percentile(itl, 99),
        "itl_mean_ms": 1000 * statistics.fmean(itl),
        "output_tokens_per_s": tokens / elapsed,
        "seconds": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--served-model-name", default="SmolLM2-135M-Instruct")
    parser.add_argument("--model", default=None, help="the model the services run (default: SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="benchmarks/results/serving_latency.json")
    args = parser.parse_args()

    engine = LLMEngine(args.model, EngineConfig(), device="cpu")
    prompts = make_prompts(args.num_prompts, engine.vocab_size, args.seed)
    offline(engine, [p[:8] for p in prompts[:2]], 4, 2)  # warm-up
    results = {
        "gateway": through_gateway(
            args.url, args.served_model_name, prompts, args.max_tokens, args.concurrency
        )
    }
    # The services' worker is idle again before the offline run shares the same cores.
    results["offline"] = offline(engine, prompts, args.max_tokens, args.concurrency)
    print(f"{args.num_prompts} requests, {args.concurrency} in flight, {args.max_tokens} output tokens each")
    print(f"{'path':10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'tok/s':>7}")
    for name, r in results.items():
        print(
            f"{name:10} {r['ttft_p50_ms']:8.1f}ms {r['ttft_p99_ms']:8.1f}ms {r['itl_p50_ms']:7.1f}ms "
            f"{r['itl_p99_ms']:7.1f}ms {r['output_tokens_per_s']:7.1f}"
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
