"""The control plane at scale, with simulated workers: the scheduler's admission rate and latency, one gateway
holding many streams, and a process of workers killed under load.

    .venv/bin/python benchmarks/control_plane.py                 # the full run: 100 workers, 1,000 streams
    .venv/bin/python benchmarks/control_plane.py --workers 10 --requests 500 --rates 200 --streams 50

Every process is real: redis (REDIS_URL, under a prefix of the run's own, deleted at the end), the scheduler
and the gateway (gunicorn, default settings), and simulated workers (gpu_worker.simulation: the real worker
service around a step-time model), several per process. Scenarios:

- admission: --requests requests (one output token each) go into the requests stream at once; the scheduler
  admits them across --workers simulated workers. Admission rate: requests / time until the scheduler has
  admitted them all. Queue time: from a request's entry in the requests stream to its inbox entry, both by the
  Redis server's clock, from the scheduler's own histogram (vllm:request_queue_time_seconds; a quantile is
  the bound of the bucket that holds it). Every request must have run exactly once: one token in its record
  (0 lost, 0 duplicated).
- paced: the same at fixed offered rates (--rates, requests/s, --paced-s each).
- streams: --streams concurrent streaming completions through the gateway, fed by --stream-workers simulated
  workers in two processes (a step takes --step-ms); each request is also read straight from its Redis
  channel. Inter-token latency (ITL) both ways: what the gateway adds is the difference. Midway, kill -9 of
  one of the two worker processes: every stream must still end with all its tokens, and none with an error.

Prints a table; writes JSON and a PNG plot (latency distributions).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import redis
from services import delete_keys
from workloads import percentile, save_figure

from shared.keys import Keys
from shared.protocol import (
    QUEUE_TIME_BUCKETS_S,
    GenerateRequest,
    SchedulerStats,
    TokenEvent,
    decode,
)
from shared.redis_client import connect
from shared.registry import WorkerRegistry
from shared.sampling import SamplingSpec
from shared.streams import queue_request

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"admissions_per_s": 5000.0, "admission_p99_ms": 5.0, "itl_p99_added_ms": 5.0}
PROMPT_LEN = 8


class Processes:
    """The run's processes, each logging to a file of its own; stopped (TERM, then KILL) at the end."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs, self.procs = env, logs, dict[str, subprocess.Popen[bytes]]()
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, *args: str, **env: str) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", *args], env={**self.env, **env}, cwd=ROOT, stdout=log, stderr=log
            )
        self.procs[name] = proc
        return proc

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_for(what: str, predicate: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def request(rid: str, max_tokens: int) -> GenerateRequest:
    prompt = [random.randrange(1, 4000) for _ in range(PROMPT_LEN)]
    spec = SamplingSpec(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=spec, arrival_time=time.time())


# -- admission -----------------------------------------------------------------------------------------------


def scheduler_stats(client: redis.Redis, keys: Keys) -> SchedulerStats:
    stats = WorkerRegistry(client, keys).scheduler_stats()
    assert stats is not None, "the scheduler publishes no stats"
    return stats


def enqueue(client: redis.Redis, keys: Keys, rids: list[str]) -> None:
    """Send the requests (one pipeline): one output token each, so a worker finishes each in one step."""
    pipe = client.pipeline(transaction=False)
    for rid in rids:
        queue_request(pipe, keys.requests, request(rid, 1))
    pipe.execute()


def quantile_ms(buckets: list[int], q: float) -> float:
    """The bound of the histogram bucket holding quantile q (counts cumulative, QUEUE_TIME_BUCKETS_S)."""
    target = q * buckets[-1]
    for bound, count in zip(QUEUE_TIME_BUCKETS_S, buckets):
        if count >= target:
            return 1000 * bound
    return float("inf")


def served_once(client: redis.Redis, keys: Keys, rids: list[str]) -> tuple[int, int]:
    """(lost, duplicated): requests with no token recorded, and requests run more than once (each ran for
    one token, so a second run shows as a second token in its record)."""
    lost = duplicated = 0
    for i in range(0, len(rids), 1000):
        pipe = client.pipeline(transaction=False)
        for rid in rids[i : i + 1000]:
            pipe.llen(keys.tokens(rid, 0))
        for count in pipe.execute():
            lost += count == 0
            duplicated += max(0, count - 1)
    return lost, duplicated


def redis_cpu_s(client: redis.Redis) -> float:
    """The Redis server's CPU time so far (user and system, all its threads), from INFO: what the run's
    figures of Redis CPU are differences of, so REDIS_URL should be a Redis of the run's own."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def idle_redis_cpu(client: redis.Redis, seconds: float = 2.0) -> float:
    """Redis's CPU seconds a second with the services idle (heartbeats, idle polls), to take off a run's."""
    before = redis_cpu_s(client)
    time.sleep(seconds)
    return (redis_cpu_s(client) - before) / seconds


def admit(
    client: redis.Redis, keys: Keys, name: str, rids: list[str], rate: float | None, idle_cpu: float
) -> dict[str, Any]:
    """Send rids (at once, or at rate per second), wait until the scheduler admitted all and the workers ran
    them; the figures of this run alone (the histogram's difference; Redis's CPU less its idle rate)."""
    before = scheduler_stats(client, keys)
    cpu_before = redis_cpu_s(client)
    start = time.monotonic()
    step = len(rids) if rate is None else max(1, int(rate / 100))  # batches every 10 ms or so
    for i in range(0, len(rids), step):
        if rate is not None:
            time.sleep(max(0.0, start + i / rate - time.monotonic()))
        enqueue(client, keys, rids[i : i + step])
    target = before.num_admitted + len(rids)
    wait_for(f"{name}'s admissions", lambda: scheduler_stats(client, keys).num_admitted >= target, 600)
    admitted_s = time.monotonic() - start
    after = scheduler_stats(client, keys)
    buckets = [b - a for a, b in zip(before.queue_time_buckets, after.queue_time_buckets)]
    wait_for(f"{name}'s tokens", lambda: served_once(client, keys, rids)[0] == 0, 120)
    redis_cpu = redis_cpu_s(client) - cpu_before - idle_cpu * (time.monotonic() - start)
    lost, duplicated = served_once(client, keys, rids)
    return {
        "scenario": name,
        "requests": len(rids),
        "offered_per_s": rate,
        "admissions_per_s": len(rids) / admitted_s,
        "latency_ms": {q: quantile_ms(buckets, q / 100) for q in (50, 90, 99)},
        "queue_time_buckets": buckets,
        "lost": lost,
        "duplicated": duplicated,
        "redis_cpu_us_per_request": 1e6 * redis_cpu / len(rids),
    }


def run_admission(client: redis.Redis, keys: Keys, args: argparse.Namespace) -> list[dict[str, Any]]:
    idle_cpu = idle_redis_cpu(client)
    rows = [admit(client, keys, "burst", [f"burst-{i}" for i in range(args.requests)], None, idle_cpu)]
    for rate in args.rates:
        rids = [f"paced-{rate:g}-{i}" for i in range(int(rate * args.paced_s))]
        rows.append(admit(client, keys, f"paced {rate:g}/s", rids, rate, idle_cpu))
    return rows


# -- streams -------------------------------------------------------------------------------------------------


def read_channels(redis_url: str, pattern: str, out: Path, stop: Any) -> None:
    """In a process of its own: every token event of the run, straight from Redis (one pattern subscription),
    written as `<request id> <arrival time> <tokens>` lines."""
    pubsub = connect(redis_url).pubsub()
    pubsub.psubscribe(pattern)
    with out.open("w") as log:
        while not stop.is_set():
            message = pubsub.get_message(timeout=0.1)
            if message is not None and message["type"] == "pmessage":
                event = decode(TokenEvent, message["data"])
                log.write(f"{event.request_id} {time.time()} {len(event.token_ids)}\n")


def channel_arrivals(path: Path) -> dict[str, list[float]]:
    arrivals: dict[str, list[float]] = {}
    for line in path.read_text().splitlines():
        rid, at, count = line.split()
        arrivals.setdefault(rid, []).extend([float(at)] * int(count))
    return arrivals


async def stream_one(http: httpx.AsyncClient, url: str, max_tokens: int, out: dict[str, Any]) -> None:
    body = {"prompt": [random.randrange(1, 4000) for _ in range(PROMPT_LEN)], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    times: list[float] = []
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("id: "):
                    out.setdefault("rid", line[4:].split(":")[0])
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out["error"] = chunk["error"]["code"]
                    elif chunk.get("usage"):
                        out["tokens"] = chunk["usage"]["completion_tokens"]
                    elif chunk["choices"] and chunk["choices"][0]["text"]:
                        times.append(time.time())
    except httpx.HTTPError as e:
        out["error"] = type(e).__name__
    out["times"] = times


def itls(times: list[float]) -> list[float]:
    return [1000 * (b - a) for a, b in itertools.pairwise(times)]


async def stream_all(url: str, args: argparse.Namespace, kill: Any) -> tuple[list[dict[str, Any]], float]:
    limits = httpx.Limits(max_connections=args.streams + 10, max_keepalive_connections=0)
    results: list[dict[str, Any]] = [{} for _ in range(args.streams)]
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        tasks = [asyncio.create_task(stream_one(http, url, args.stream_tokens, r)) for r in results]
        await asyncio.sleep(args.kill_after_s)
        killed_at = time.time()
        kill()
        await asyncio.gather(*tasks)
    return results, killed_at


def run_streams(url: str, redis_url: str, keys: Keys, args: argparse.Namespace, kill: Any) -> dict[str, Any]:
    """The streams; the Redis channels are read by another process (it must not share the client's loop)."""
    context = multiprocessing.get_context("fork")
    stop, log = context.Event(), Path(args.json).parent / "control_plane_channels.txt"
    reader = context.Process(target=read_channels, args=(redis_url, keys.events("*"), log, stop))
    reader.start()
    time.sleep(0.5)
    client = connect(redis_url)
    idle_cpu = idle_redis_cpu(client)
    cpu_before, start = redis_cpu_s(client), time.monotonic()
    try:
        results, killed_at = asyncio.run(stream_all(url, args, kill))
        redis_cpu = redis_cpu_s(client) - cpu_before - idle_cpu * (time.monotonic() - start)
    finally:
        time.sleep(0.5)
        stop.set()
        reader.join(timeout=10)
    arrivals = channel_arrivals(log)
    gateway = [x for r in results for x in itls(r["times"])]
    direct = [x for r in results if "rid" in r for x in itls(arrivals.get(r["rid"], []))]
    return {
        "streams": args.streams,
        "errors": sum(1 for r in results if "error" in r),
        "incomplete": sum(1 for r in results if "error" not in r and r.get("tokens") != args.stream_tokens),
        "killed_after_s": round(killed_at - min(t for r in results for t in r["times"][:1]), 2),
        "itl_gateway_ms": {q: percentile(gateway, q) for q in (50, 99)},
        "itl_direct_ms": {q: percentile(direct, q) for q in (50, 99)},
        "itl_p99_added_ms": percentile(gateway, 99) - percentile(direct, 99),
        # Every stream's whole life (submit, admission, tokens, the channel reader's copy), a token streamed.
        "redis_cpu_us_per_token": 1e6 * redis_cpu / max(1, sum(r.get("tokens", 0) for r in results)),
        "gateway_itls_ms": gateway,
        "direct_itls_ms": direct,
    }


# -- the run -------------------------------------------------------------------------------------------------


def print_table(admission: list[dict[str, Any]], streams: dict[str, Any]) -> None:
    print("| scenario | requests | admitted/s | enqueue to inbox p50 / p99 ms | lost | duplicated "
          "| Redis CPU µs a request |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in admission:
        lat = row["latency_ms"]
        print(f"| {row['scenario']} | {row['requests']} | {row['admissions_per_s']:.0f} | "
              f"{lat[50]:g} / {lat[99]:g} | {row['lost']} | {row['duplicated']} | "
              f"{row['redis_cpu_us_per_request']:.1f} |")  # fmt: skip
    g, d = streams["itl_gateway_ms"], streams["itl_direct_ms"]
    print(f"\n{streams['streams']} streams through one gateway, one of two worker processes killed after "
          f"{streams['killed_after_s']} s: {streams['errors']} errors, {streams['incomplete']} incomplete; "
          f"ITL p50/p99 {g[50]:.1f}/{g[99]:.1f} ms at the client, "
          f"{d[50]:.1f}/{d[99]:.1f} ms on the Redis channel "
          f"(p99 added: {streams['itl_p99_added_ms']:+.1f} ms); Redis CPU "
          f"{streams['redis_cpu_us_per_token']:.1f} µs a token streamed")  # fmt: skip


def plot(admission: list[dict[str, Any]], streams: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for row in admission:
        total = row["queue_time_buckets"][-1] or 1
        bounds = [1000 * b for b in QUEUE_TIME_BUCKETS_S]
        left.step(
            bounds, [c / total for c in row["queue_time_buckets"][:-1]], where="post", label=row["scenario"]
        )
    left.set(xscale="log", xlabel="queue time, requests stream to inbox (ms)", ylabel="fraction of requests",
             title="admission")  # fmt: skip
    left.legend()
    for name, key in (("client (gateway)", "gateway_itls_ms"), ("Redis channel", "direct_itls_ms")):
        values = sorted(streams[key])
        right.plot(values, [i / len(values) for i in range(len(values))], label=name)
    right.set(xlabel="inter-token latency (ms)", title=f"{streams['streams']} streams")
    right.legend()
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=100, help="simulated workers for the admission runs")
    parser.add_argument("--requests", type=int, default=20000, help="requests in the burst")
    parser.add_argument("--rates", type=float, nargs="*", default=[1000, 2500, 5000], help="offered rates")
    parser.add_argument("--paced-s", type=float, default=4.0, help="seconds of each paced run")
    parser.add_argument("--streams", type=int, default=1000, help="concurrent streams through the gateway")
    parser.add_argument("--stream-workers", type=int, default=40, help="simulated workers feeding them")
    parser.add_argument("--stream-tokens", type=int, default=40, help="tokens per stream")
    parser.add_argument("--step-ms", type=float, default=200.0, help="a simulated step, in the streams run")
    parser.add_argument("--kill-after-s", type=float, default=4.0, help="when a worker process is killed")
    parser.add_argument("--json", default="benchmarks/results/control_plane.json")
    parser.add_argument("--plot", default="benchmarks/results/control_plane.png")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    random.seed(0)
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    base = {**os.environ, "REDIS_URL": redis_url, "LOG_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1"}

    # Admission: workers with blocks to spare, whose steps take 1 ms.
    keys = Keys(f"pagedserve-cp-{uuid.uuid4().hex[:8]}")
    client = connect(redis_url)
    procs = Processes({**base, "REDIS_PREFIX": keys.prefix}, out.parent / "control_plane_logs")
    try:
        procs.start("scheduler", "scheduler_svc")
        procs.start("workers", "gpu_worker.simulation", "--workers", str(args.workers), "--step-ms", "1",
                    "--per-token-us", "0", NUM_KV_BLOCKS="2048")  # fmt: skip
        wait_for("the workers", lambda: len(WorkerRegistry(client, keys).live_worker_ids()) >= args.workers)
        wait_for("the scheduler", lambda: WorkerRegistry(client, keys).scheduler_stats() is not None)
        admission = run_admission(client, keys, args)
    finally:
        procs.stop()
        delete_keys(redis_url, keys)

    # Streams: the gateway with its defaults, workers in two processes, one killed midway.
    keys = Keys(f"pagedserve-cp-{uuid.uuid4().hex[:8]}")
    port = 20000 + random.randrange(20000)
    env = {**base, "REDIS_PREFIX": keys.prefix, "PORT": str(port), "HEARTBEAT_TTL_S": "2",
           "HEARTBEAT_INTERVAL_S": "0.5", "NUM_KV_BLOCKS": "4096"}  # fmt: skip
    procs = Processes(env, out.parent / "control_plane_logs")
    url = f"http://127.0.0.1:{port}"
    try:
        procs.start("scheduler-2", "scheduler_svc")
        half = max(1, args.stream_workers // 2)
        for name in ("kept", "doomed"):
            procs.start(name, "gpu_worker.simulation", "--workers", str(half), "--name", name,
                        "--step-ms", str(args.step_ms), "--per-token-us", "0")  # fmt: skip
        procs.start("gateway", "gateway")
        wait_for(
            "the gateway",
            lambda: ready(url) and len(WorkerRegistry(client, keys).live_worker_ids()) >= 2 * half,
        )
        streams = run_streams(url, redis_url, keys, args, procs.procs["doomed"].kill)
    finally:
        procs.stop()
        delete_keys(redis_url, keys)

    results = {"targets": TARGETS, "args": vars(args), "admission": admission, "streams": streams}
    out.write_text(json.dumps(results, indent=2))
    plot(admission, streams, Path(args.plot))
    print_table(admission, streams)
    print(f"\nwrote {out} and {args.plot}")
    return results


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
