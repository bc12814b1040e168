"""Routing by prefix against routing by load: the same requests, in the same order, through the scheduler
under ROUTING_POLICY=prefix and then ROUTING_POLICY=load, each policy on services started for it alone.

    .venv/bin/python benchmarks/routing.py                      # the full run, default model; a few minutes
    .venv/bin/python benchmarks/routing.py --groups 2 --rounds 2 --hot-requests 4 --workers 10 --requests 300

Every process is real: redis (REDIS_URL, under a prefix of each run's own, deleted at its end), the scheduler,
and for the first two scenarios two workers on the model (--model, default SmolLM2-135M-Instruct; one torch
thread each, DTYPE float32 unless set) behind one gateway (one gunicorn worker). Scenarios (--scenarios):

- groups: --groups groups of requests, each group a PREFIX_LEN-token prefix of its own (random token ids,
  seeded) plus SUFFIX_LEN tokens of each request's own; each of --rounds rounds sends one request per group,
  in a shuffled order, --concurrency in flight, --max-tokens output tokens each (greedy, ignore_eos; the
  openai client, streaming, include_usage). Each worker's KV pool holds about half of the groups' prefixes,
  so by load every worker cycles through all of them and evicts, while by prefix each can keep its own half.
  Hit fraction: prompt tokens found cached (usage.prompt_tokens_details.cached_tokens) / prompt tokens, over
  every request and over the warm rounds (all but the first, where nothing can be cached); the workers'
  own counters (prefix_cache_hits_total / prefix_cache_queries_total) and an oracle (below) beside it.
  TTFT (sent to first text) mean and p99, output tokens/s over the scenario.
- hot: --hot-requests requests sharing one prefix, --hot-concurrency in flight: each worker's share of the
  prompt tokens (heartbeat prompt_tokens_total), which the load limit is to keep spreading.
- scale: --workers simulated workers (gpu_worker.simulation, at most SIM_PER_PROCESS a process, SCALE_BLOCKS
  blocks each) and --requests requests, one output token each, queued at once straight into the requests
  stream, their prompts a prefix drawn from --prefixes prefixes by a Zipf law (exponent ZIPF_S) plus tokens
  of their own. Admissions/s: requests / time until the scheduler admitted all of them (as in
  control_plane.py); the routing cost per request is the difference of the time per admission of the two
  policies. Hit fraction as routed (the scheduler's routed_matched_blocks / routed_prompt_blocks) and as
  found (the workers' counters, in tokens); max/min of the prompt tokens the workers took in. Every request
  must have run exactly once. --scale-runs runs per policy, the policies taking turns; the table gives the
  median of each figure and the rate and load ratio of every run (on a shared machine a run's rate varies
  by a third from one to the next).
- models: two simulated workers of two models, one model flooded with requests: the other's queue time
  against its idle value (benchmarks/model_queues.py; once, not per policy).

The oracle: one LRU cache with as many blocks as all the workers together, fed the same prompts in the same
order block by block (a prompt's run of cached blocks from its start are hits, then all its blocks are used,
its first last, so its tail is evicted first); hit blocks / prompt blocks, in tokens: hit blocks x block size
/ prompt tokens. Targets: by prefix, hit fraction >= 0.8 and TTFT mean <= 0.5 x load's (groups, warm rounds);
each worker >= 30% of the prompt tokens (hot); >= 5,000 admissions/s and max/min load <= 1.5 (scale).
Prints tables; writes JSON and a PNG plot to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import queue
import random
import statistics
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import redis
from control_plane import Processes, ready, scheduler_stats, served_once, wait_for
from model_queues import print_table as print_models
from model_queues import run_models
from services import delete_keys
from workloads import FIRST_TOKEN_ID, percentile, save_figure, write_json

from shared.keys import Keys
from shared.prefix import block_hashes
from shared.protocol import GenerateRequest
from shared.redis_client import connect
from shared.registry import WorkerRegistry
from shared.sampling import SamplingSpec
from shared.streams import queue_request

POLICIES = ("prefix", "load")
SCENARIOS = ("groups", "hot", "scale", "models")
TARGETS = {"groups_hit": 0.8, "groups_ttft": 0.5, "hot_share": 0.3, "admissions_per_s": 5000.0,
           "max_min_load": 1.5}  # fmt: skip
BLOCK_SIZE = 16
# Prompt token ids: ordinary ones of the default tokenizer, and inside the simulated model's vocabulary.
LAST_TOKEN_ID = 4000
PREFIX_LEN, SUFFIX_LEN = 400, 16  # groups and hot: 25 blocks shared, one of the request's own
POOL_SLACK_BLOCKS = 16  # beyond half the groups' prefixes: the requests in flight, the watermark
SCALE_PREFIX_LEN, SCALE_SUFFIX_LEN = 64, 8  # scale: 4 blocks shared, a partial block of the request's own
SCALE_BLOCKS = 2048  # per simulated worker: every request of the burst finds room at once
SIM_PER_PROCESS = 50
ZIPF_S = 1.0


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, LAST_TOKEN_ID) for _ in range(n)]


def group_prompts(groups: int, rounds: int, seed: int) -> list[tuple[int, list[int]]]:
    """(round, prompt) in sending order: each round one request per group, shuffled."""
    rng = random.Random(seed)
    prefixes = [random_ids(rng, PREFIX_LEN) for _ in range(groups)]
    order = []
    for r in range(rounds):
        for g in rng.sample(range(groups), groups):
            order.append((r, prefixes[g] + random_ids(rng, SUFFIX_LEN)))
    return order


def zipf_prompts(num: int, num_prefixes: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [random_ids(rng, SCALE_PREFIX_LEN) for _ in range(num_prefixes)]
    weights = list(itertools.accumulate(1 / (k + 1) ** ZIPF_S for k in range(num_prefixes)))
    drawn = rng.choices(range(num_prefixes), cum_weights=weights, k=num)
    return [prefixes[p] + random_ids(rng, SCALE_SUFFIX_LEN) for p in drawn]


def oracle(prompts: list[list[int]], capacity_blocks: int) -> dict[str, float]:
    """Hit fractions (blocks, tokens) of one LRU cache of capacity_blocks fed the prompts in order. A prompt's
    cacheable blocks are those a worker's cache could give it: its full blocks less one ending at its last
    token (scheduler_svc.queue); its blocks are all those it takes (the units of routed_prompt_blocks)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = blocks = tokens = 0
    for prompt in prompts:
        hashes = block_hashes(prompt, BLOCK_SIZE, end_block=(len(prompt) - 1) // BLOCK_SIZE)
        run = next((i for i, h in enumerate(hashes) if h not in cache), len(hashes))
        hits, blocks, tokens = hits + run, blocks - (-len(prompt) // BLOCK_SIZE), tokens + len(prompt)
        for h in reversed(hashes):  # NOTE: the head is used last, so tail blocks are evicted first
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return {"blocks": hits / blocks, "tokens": hits * BLOCK_SIZE / tokens}


# -- through the gateway -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    """One request through the gateway; times in seconds from when it was sent."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    end_s: float = 0.0  # from the scenario's start
    error: str | None = None


def send_all(api: openai.OpenAI, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[Result]:
    """The prompts in order, concurrency in flight (each thread takes the next one when its own ends)."""
    model = api.models.list().data[0].id
    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(prompts)):
        todo.put(i)
    results = [Result() for _ in prompts]
    start = time.perf_counter()

    def one(i: int) -> None:
        sent, result = time.perf_counter(), results[i]
        try:
            stream = api.completions.create(
                model=model, prompt=prompts[i], max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text and not result.ttft_s:
                    result.ttft_s = time.perf_counter() - sent
                if (usage := chunk.usage) is not None:
                    result.prompt_tokens, result.output_tokens = usage.prompt_tokens, usage.completion_tokens
                    details = usage.prompt_tokens_details
                    result.cached_tokens = (details.cached_tokens or 0) if details else 0
            if result.output_tokens != max_tokens or not result.ttft_s:
                result.error = f"{result.output_tokens} tokens, expected {max_tokens}"
        except openai.OpenAIError as e:  # counted; the others go on
            result.error = f"{type(e).__name__}: {e}"
        result.end_s = time.perf_counter() - start

    def loop() -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                one(todo.get_nowait())

    threads = [threading.Thread(target=loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@dataclass(frozen=True, slots=True)
class Counts:
    """A worker's heartbeat counters: prompt tokens taken in, looked up in its prefix cache, found there."""

    prompt: int = 0
    queries: int = 0
    hits: int = 0

    def minus(self, other: Counts) -> Counts:
        return Counts(self.prompt - other.prompt, self.queries - other.queries, self.hits - other.hits)


def settled(
    client: redis.Redis, keys: Keys, before: dict[str, Counts], prompt_tokens: int
) -> dict[str, Counts]:
    """Each worker's counts since before, once heartbeats that say nothing runs add up to prompt_tokens more
    prompt tokens: a heartbeat's counters are of one moment, so none is still to be counted."""
    deltas: dict[str, Counts] = {}

    def done() -> bool:
        live = WorkerRegistry(client, keys).read().live
        deltas.clear()
        for w, b in sorted(live.items()):
            now = Counts(b.prompt_tokens_total, b.prefix_cache_queries_total, b.prefix_cache_hits_total)
            deltas[w] = now.minus(before.get(w, Counts()))
        idle = all(b.num_running == b.num_waiting == 0 for b in live.values())
        return idle and sum(c.prompt for c in deltas.values()) >= prompt_tokens

    wait_for("the workers' counters", done, 120)
    return deltas


def fraction(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def hit_fraction(results: list[Result]) -> float:
    return fraction(sum(r.cached_tokens for r in results), sum(r.prompt_tokens for r in results))


def found_fraction(deltas: dict[str, Counts]) -> float:
    return fraction(sum(c.hits for c in deltas.values()), sum(c.queries for c in deltas.values()))


def served(name: str, results: list[Result], deltas: dict[str, Counts], warm: list[bool]) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    assert ok, f"{name}: every request failed: {results[0].error}"
    warm_ok = [r for r, w in zip(results, warm) if w and r.error is None]
    ttfts = [1000 * r.ttft_s for r in ok]
    total = sum(c.prompt for c in deltas.values())
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "hit_fraction": hit_fraction(ok),
        "hit_fraction_warm": hit_fraction(warm_ok),
        "workers_hit_fraction": found_fraction(deltas),
        "ttft_ms": {"mean": statistics.fmean(ttfts)} | {f"p{q}": percentile(ttfts, q) for q in (50, 99)},
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / max(r.end_s for r in ok),
        "worker_prompt_share": {w: fraction(c.prompt, total) for w, c in deltas.items()},
        "ttfts_ms": ttfts,
    }


@contextlib.contextmanager
def real_cluster(policy: str, pool: int, base: dict[str, str], logs: Path) -> Iterator[tuple[str, Keys]]:
    """Scheduler, two workers on the model, one gateway; stopped and their keys deleted at the end."""
    keys = Keys(f"pagedserve-route-{uuid.uuid4().hex[:8]}")
    port = 20000 + random.randrange(20000)
    env = {**base, "REDIS_PREFIX": keys.prefix, "PORT": str(port), "NUM_KV_BLOCKS": str(pool),
           "ROUTING_POLICY": policy, "GATEWAY_WORKERS": "1"}  # fmt: skip
    procs, url = Processes(env, logs), f"http://127.0.0.1:{port}"
    client = connect(base["REDIS_URL"])
    try:
        procs.start(f"{policy}-scheduler", "scheduler_svc")
        for wid in ("w0", "w1"):
            procs.start(f"{policy}-{wid}", "gpu_worker", WORKER_ID=wid)
        procs.start(f"{policy}-gateway", "gateway")
        wait_for(
            f"the {policy} services",
            lambda: ready(url) and len(WorkerRegistry(client, keys).live_worker_ids()) == 2,
            300,
        )
        yield url, keys
    finally:
        procs.stop()
        delete_keys(base["REDIS_URL"], keys)


def run_served(policy: str, args: argparse.Namespace, base: dict[str, str], logs: Path) -> dict[str, Any]:
    """The groups and hot scenarios on one cluster under policy."""
    prefix_blocks = PREFIX_LEN // BLOCK_SIZE
    pool = (args.groups * prefix_blocks + 1) // 2 + POOL_SLACK_BLOCKS
    rows: dict[str, Any] = {"num_kv_blocks": pool}
    with (
        real_cluster(policy, pool, base, logs) as (url, keys),
        # Closed before the services stop: the gateway waits for no idle connection of ours.
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600) as api,
    ):
        client = connect(base["REDIS_URL"])
        send_all(api, [random_ids(random.Random(-1), 8)], 1, 2)  # warm-up: the gateway's first request
        jobs = []
        if "groups" in args.scenarios:
            order = group_prompts(args.groups, args.rounds, args.seed)
            jobs.append(("groups", [p for _, p in order], [r > 0 for r, _ in order], args.concurrency))
        if "hot" in args.scenarios:
            rng = random.Random(args.seed + 1)
            hot = random_ids(rng, PREFIX_LEN)
            prompts = [hot + random_ids(rng, SUFFIX_LEN) for _ in range(args.hot_requests)]
            jobs.append(("hot", prompts, [True] * len(prompts), args.hot_concurrency))
        for name, prompts, warm, concurrency in jobs:
            before = settled(client, keys, {}, 0)
            results = send_all(api, prompts, concurrency, args.max_tokens)
            deltas = settled(client, keys, before, sum(map(len, prompts)))
            rows[name] = served(name, results, deltas, warm) | {"oracle": oracle(prompts, 2 * pool)}
            print(f"{policy}: {name} done", flush=True)
    return rows


# -- scale, simulated workers --------------------------------------------------------------------------------


def run_scale(policy: str, args: argparse.Namespace, base: dict[str, str], logs: Path) -> dict[str, Any]:
    keys = Keys(f"pagedserve-route-{uuid.uuid4().hex[:8]}")
    env = {**base, "REDIS_PREFIX": keys.prefix, "ROUTING_POLICY": policy, "NUM_KV_BLOCKS": str(SCALE_BLOCKS)}
    procs, client = Processes(env, logs), connect(base["REDIS_URL"])
    prompts = zipf_prompts(args.requests, args.prefixes, args.seed + 2)
    rids = [f"{policy}-{i}" for i in range(len(prompts))]
    try:
        scheduler = procs.start(f"{policy}-scale-scheduler", "scheduler_svc")
        sims = []
        for k, first in enumerate(range(0, args.workers, SIM_PER_PROCESS)):
            count = min(SIM_PER_PROCESS, args.workers - first)
            sim = ("--workers", str(count), "--name", f"sim{k}", "--step-ms", "1", "--per-token-us", "0")
            sims.append(procs.start(f"{policy}-sim-{k}", "gpu_worker.simulation", *sim))
        wait_for(
            "the simulated workers",
            lambda: len(WorkerRegistry(client, keys).live_worker_ids()) >= args.workers,
            300,
        )
        wait_for("the scheduler", lambda: WorkerRegistry(client, keys).scheduler_stats() is not None)
        capacity = sum(b.total_blocks for b in WorkerRegistry(client, keys).read().live.values())
        before, stats_before = settled(client, keys, {}, 0), scheduler_stats(client, keys)
        spec = SamplingSpec(temperature=0.0, max_tokens=1, ignore_eos=True)
        now = time.time()
        requests = [GenerateRequest(request_id=rid, prompt_token_ids=p, sampling=spec, arrival_time=now)
                    for rid, p in zip(rids, prompts)]  # fmt: skip
        pids = [p.pid for p in [scheduler, *sims]]
        start, cpu_before = time.monotonic(), [cpu_s(pid) for pid in pids]
        for i in range(0, len(requests), 1000):
            pipe = client.pipeline(transaction=False)
            for request in requests[i : i + 1000]:
                queue_request(pipe, keys.requests, request)
            pipe.execute()
        target = stats_before.num_admitted + len(rids)
        wait_for("the admissions", lambda: scheduler_stats(client, keys).num_admitted >= target, 600)
        admitted_s = time.monotonic() - start
        cpu = [cpu_s(pid) - before for pid, before in zip(pids, cpu_before)]
        stats = scheduler_stats(client, keys)
        wait_for("the tokens", lambda: served_once(client, keys, rids)[0] == 0, 300)
        lost, duplicated = served_once(client, keys, rids)
        deltas = settled(client, keys, before, sum(map(len, prompts)))
    finally:
        procs.stop()
        delete_keys(base["REDIS_URL"], keys)
    loads = sorted(c.prompt for c in deltas.values())
    return {
        "workers": len(deltas),
        "requests": len(rids),
        "admissions_per_s": len(rids) / admitted_s,
        "us_per_admission": 1e6 * admitted_s / len(rids),
        # CPU time over the burst per request: the scheduler's, and the simulated workers' together.
        "scheduler_cpu_us_per_admission": 1e6 * cpu[0] / len(rids),
        "workers_cpu_us_per_admission": 1e6 * sum(cpu[1:]) / len(rids),
        "routed_hit_fraction": fraction(
            stats.routed_matched_blocks - stats_before.routed_matched_blocks,
            stats.routed_prompt_blocks - stats_before.routed_prompt_blocks,
        ),
        "workers_hit_fraction": found_fraction(deltas),
        "oracle": oracle(prompts, capacity),
        "oracle_capacity_blocks": capacity,
        "max_min_load": loads[-1] / loads[0] if loads[0] else None,  # None: a worker took nothing
        "worker_prompt_tokens": loads,
        "prompt_tokens_by_worker": {w: c.prompt for w, c in deltas.items()},
        "lost": lost,
        "duplicated": duplicated,
    }


def cpu_s(pid: int) -> float:
    """CPU seconds a process has used (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs of one policy as one: the median of each figure, lost and duplicated summed, the lists of
    the run with the median rate; every run kept under "runs"."""
    by_rate = sorted(runs, key=lambda r: r["admissions_per_s"])
    summary = dict(by_rate[(len(runs) - 1) // 2])
    for key in ("admissions_per_s", "us_per_admission", "scheduler_cpu_us_per_admission",
                "workers_cpu_us_per_admission", "routed_hit_fraction", "workers_hit_fraction"):  # fmt: skip
        summary[key] = statistics.median(r[key] for r in runs)
    ratios = [r["max_min_load"] for r in runs]
    summary["max_min_load"] = None if None in ratios else statistics.median(ratios)
    summary["lost"], summary["duplicated"] = sum(r["lost"] for r in runs), sum(r["duplicated"] for r in runs)
    summary["runs"] = runs
    return summary


# -- the run -------------------------------------------------------------------------------------------------


def verdicts(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target a scenario of this run speaks to, by prefix (against load, for TTFT)."""
    p, t, out = results["prefix"], TARGETS, []
    if "groups" in p:
        hit = p["groups"]["hit_fraction_warm"]
        ratio = p["groups"]["ttft_ms"]["mean"] / results["load"]["groups"]["ttft_ms"]["mean"]
        out += [
            (
                f"groups: hit fraction >= {t['groups_hit']} (warm rounds)",
                f"{hit:.3f}",
                hit >= t["groups_hit"],
            ),
            (
                f"groups: TTFT mean <= {t['groups_ttft']} x load's",
                f"{ratio:.2f} x",
                ratio <= t["groups_ttft"],
            ),
        ]
    if "hot" in p:
        share = min(p["hot"]["worker_prompt_share"].values(), default=0.0)
        out += [
            (
                f"hot: each worker >= {t['hot_share']:.0%} of the prompt tokens",
                f"{share:.1%} the least",
                share >= t["hot_share"],
            )
        ]
    if "scale" in p:
        rate, ratio = p["scale"]["admissions_per_s"], p["scale"]["max_min_load"]
        out += [
            (
                f"scale: >= {t['admissions_per_s']:,.0f} admissions/s",
                f"{rate:,.0f}/s",
                rate >= t["admissions_per_s"],
            ),
            (
                f"scale: max/min load <= {t['max_min_load']}",
                f"{ratio:.2f}" if ratio else "a worker idle",
                ratio is not None and ratio <= t["max_min_load"],
            ),
        ]
    if "models" in results:
        m = results["models"]
        out.append(
            (
                f"models: flooded / idle queue time <= {m['target_ratio']:g}",
                f"{m['ratio']:.2f}",
                m["ratio"] <= m["target_ratio"],
            )
        )
    return [{"target": target, "result": result, "met": met} for target, result, met in out]  # fmt: skip


def ttft(r: dict[str, Any]) -> str:
    return f"{r['ttft_ms']['mean']:.0f} / {r['ttft_ms']['p99']:.0f}"


COLUMNS: dict[str, dict[str, Callable[[dict[str, Any]], Any]]] = {
    "groups": {
        "requests": lambda r: r["requests"],
        "hit fraction all / warm rounds": lambda r: f"{r['hit_fraction']:.3f} / {r['hit_fraction_warm']:.3f}",
        "workers' counters": lambda r: f"{r['workers_hit_fraction']:.3f}",
        "oracle": lambda r: f"{r['oracle']['tokens']:.3f}",
        "TTFT mean / p99 ms": ttft,
        "output tok/s": lambda r: f"{r['output_tokens_per_s']:.1f}",
        "failed": lambda r: r["failed"],
    },
    "hot": {
        "requests": lambda r: r["requests"],
        "prompt tokens per worker": lambda r: " / ".join(
            f"{s:.0%}" for s in r["worker_prompt_share"].values()
        ),
        "hit fraction": lambda r: f"{r['hit_fraction']:.3f}",
        "TTFT mean / p99 ms": ttft,
        "failed": lambda r: r["failed"],
    },
    "scale": {
        "workers": lambda r: r["workers"],
        "requests": lambda r: f"{r['requests']:,}",
        "admitted/s": lambda r: f"{r['admissions_per_s']:,.0f}",
        "us / admission": lambda r: f"{r['us_per_admission']:.0f}",
        "CPU us / admission: scheduler, workers": lambda r: (
            f"{r['scheduler_cpu_us_per_admission']:.0f}, {r['workers_cpu_us_per_admission']:.0f}"
        ),
        "hit fraction routed (blocks)": lambda r: f"{r['routed_hit_fraction']:.3f}",
        "found (tokens)": lambda r: f"{r['workers_hit_fraction']:.3f}",
        "oracle blocks / tokens": lambda r: f"{r['oracle']['blocks']:.3f} / {r['oracle']['tokens']:.3f}",
        "max/min load": lambda r: f"{r['max_min_load']:.2f}" if r["max_min_load"] else "-",
        "admitted/s, each run": lambda r: ", ".join(f"{run['admissions_per_s']:,.0f}" for run in r["runs"]),
        "max/min load, each run": lambda r: ", ".join(
            f"{run['max_min_load']:.2f}" if run["max_min_load"] else "-" for run in r["runs"]
        ),
        "lost / duplicated": lambda r: f"{r['lost']} / {r['duplicated']}",
    },
}


def print_tables(results: dict[str, Any]) -> None:
    """A markdown table per scenario (a row per policy), then the targets."""
    a = results["args"]
    titles = {
        "groups": f"groups: {a['groups']} x {a['rounds']} rounds, {a['concurrency']} in flight, two workers, "
        f"{results['prefix'].get('num_kv_blocks')} blocks",
        "hot": f"hot prefix: {a['hot_requests']} requests, {a['hot_concurrency']} in flight, two workers",
        "scale": f"scale: {a['requests']:,} requests over {a['prefixes']:,} prefixes, simulated workers",
    }
    for name in (n for n in SCENARIOS if n in results["prefix"]):
        columns = COLUMNS[name]
        print(f"\n{titles[name]}\n| policy | {' | '.join(columns)} |\n|{' --- |' * (len(columns) + 1)}")
        for policy in POLICIES:
            cells = (str(cell(results[policy][name])) for cell in columns.values())
            print(f"| {policy} | {' | '.join(cells)} |")
    print("\n| target | by prefix | |\n| --- | --- | --- |")
    for v in results["verdicts"]:
        print(f"| {v['target']} | {v['result']} | {'met' if v['met'] else 'MISSED'} |")
    if "routing_us_per_request" in results:
        print(f"\nrouting by prefix: {results['routing_us_per_request']:+.1f} us per admission against load")


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft, hits, loads) = plt.subplots(1, 3, figsize=(15, 4))
    names = [n for n in SCENARIOS if n in results["prefix"]]
    for k, policy in enumerate(POLICIES):
        r = results[policy]
        for name in ("groups", "hot"):
            if name in r:
                values = sorted(r[name]["ttfts_ms"])
                ttft.plot(values, [i / len(values) for i in range(len(values))], label=f"{name}, {policy}")
        key = {"groups": "hit_fraction", "hot": "hit_fraction", "scale": "workers_hit_fraction"}
        hits.bar(
            [i + 0.27 * (k - 1) for i in range(len(names))], [r[n][key[n]] for n in names], 0.27, label=policy
        )
        if "scale" in r:
            loads.plot(r["scale"]["worker_prompt_tokens"], label=policy)
    oracles = [results["prefix"][n]["oracle"]["tokens"] for n in names]
    hits.bar([i + 0.27 for i in range(len(names))], oracles, 0.27, label="oracle (one cache)", color="grey")
    hits.set_xticks(range(len(names)), names)
    ttft.set(xscale="log", xlabel="TTFT (ms)", ylabel="fraction of requests", title="time to first token")
    hits.set(ylabel="prompt tokens found cached", title="hit fraction")
    loads.set(xlabel="workers, sorted", ylabel="prompt tokens taken in", title="load, simulated workers")
    for ax in (ttft, hits, loads):
        ax.legend(fontsize=8)
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--model", default=None, help="model folder or GGUF file (default: SmolLM2)")
    parser.add_argument("--groups", type=int, default=8, help="groups of requests, a prefix each")
    parser.add_argument("--rounds", type=int, default=6, help="requests per group (one a round)")
    parser.add_argument("--concurrency", type=int, default=4, help="groups: requests in flight")
    parser.add_argument("--max-tokens", type=int, default=16, help="groups and hot: output tokens a request")
    parser.add_argument("--hot-requests", type=int, default=24, help="requests sharing the hot prefix")
    parser.add_argument("--hot-concurrency", type=int, default=8, help="hot: requests in flight")
    parser.add_argument("--workers", type=int, default=100, help="scale: simulated workers")
    parser.add_argument("--requests", type=int, default=20000, help="scale: requests in the burst")
    parser.add_argument("--prefixes", type=int, default=2000, help="scale: prefixes the prompts draw from")
    parser.add_argument("--scale-runs", type=int, default=3, help="scale: runs per policy (medians reported)")
    parser.add_argument("--probes", type=int, default=20, help="models: probes of the second model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results", help="folder of routing.json and .png")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    random.seed(args.seed)
    out = Path(args.out)
    logs = out / "routing_logs"
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    # DRAIN_TIMEOUT_S=0: the workers are stopped idle, with nothing to drain.
    base = {**os.environ, "REDIS_URL": redis_url, "LOG_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", "DTYPE": os.environ.get("DTYPE", "float32"),
            "BLOCK_SIZE": str(BLOCK_SIZE), "HEARTBEAT_INTERVAL_S": "0.5", "HEARTBEAT_TTL_S": "10",
            "DRAIN_TIMEOUT_S": "0"}  # fmt: skip
    if args.model:
        base["MODEL"] = args.model
    results: dict[str, Any] = {"targets": TARGETS, "args": vars(args)}
    for policy in POLICIES:
        results[policy] = {}
        if {"groups", "hot"} & set(args.scenarios):
            results[policy] |= run_served(policy, args, base, logs)
    if "scale" in args.scenarios:
        runs: dict[str, list[dict[str, Any]]] = {policy: [] for policy in POLICIES}
        for k in range(args.scale_runs):  # the policies take turns: a slow spell of the machine hits both
            for policy in POLICIES:
                runs[policy].append(run_scale(policy, args, base, logs))
                print(f"{policy}: scale run {k + 1} done", flush=True)
        for policy in POLICIES:
            results[policy]["scale"] = median_of(runs[policy])
    if "scale" in args.scenarios:
        cost = results["prefix"]["scale"]["us_per_admission"] - results["load"]["scale"]["us_per_admission"]
        results["routing_us_per_request"] = cost
    if "models" in args.scenarios:
        results["models"] = run_models(base, logs, args.probes)
        print("models done", flush=True)
    results["verdicts"] = verdicts(results)
    path = write_json(results, out / "routing.json")
    plot(results, out / "routing.png")
    print_tables(results)
    if "models" in results:
        print_models(results["models"])
    print(f"\nwrote {path} and {out / 'routing.png'}")
    return results


if __name__ == "__main__":
    main()
