"""Batch vs interactive: what a running batch (the Batch API) costs interactive chat traffic.

    .venv/bin/python benchmarks/batch_latency.py                 # starts the services itself, default model
    .venv/bin/python benchmarks/batch_latency.py --duration-s 10 --batch-lines 100     # a quick look

Without --url, the script runs scripts/run.sh in a process group of its own (Redis only if none answers at
REDIS_URL, the scheduler, one worker, one Celery batch worker and the gateway on a free port, a Redis prefix
of its own, BATCH_LINES_IN_FLIGHT from --lines-in-flight, the batch files in a temporary folder), then stops
the group and deletes the keys left under that prefix.

Phases, each --duration-s of the same closed-loop load: --clients threads, each sending one streamed chat
request after another (the openai client, temperature 0, --max-tokens output tokens with ignore_eos, short
prompts that never repeat):

- no batch: the interactive load alone.
- with batch: a --batch-lines line chat batch (--batch-max-tokens each, temperature 0, ignore_eos) is
  uploaded and created; once it is in progress, the same load runs while a thread polls the batch every
  0.5 s (completed and failed lines). After the load the polling goes on until the batch ends (at most
  --batch-timeout-s).

TTFT: from sending a request to its first chunk with content. E2E: to the end of its stream. Target: the p50
TTFT with the batch running is at most 1.5x the p50 TTFT without it. Batch lines/s: lines over the time from
creating the batch to seeing it ended. Prints a table; writes JSON and a PNG plot (TTFT distributions of both
phases; the batch's progress with the loaded window shaded).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import openai
from services import Services
from workloads import percentile, save_figure, write_json

from gpu_worker.settings import WorkerSettings

TARGET_TTFT_P50_RATIO = 1.5
POLL_S = 0.5
WARM_UP_S = 5.0
ENDED = frozenset({"completed", "failed", "expired", "cancelled"})
TOPICS = [
    "the sea", "a mountain", "bread", "a violin", "winter", "a library", "coffee", "a bridge", "the moon",
    "a garden", "trains", "honey", "a lighthouse", "chess", "rain", "a desert",
]  # fmt: skip
ASKS = ["Tell me about {}.", "Describe {} in a sentence.", "Why do people like {}?", "Write a line on {}."]


@dataclasses.dataclass(slots=True)
class RequestResult:
    """One interactive request: sent (from its phase's start), TTFT and E2E (from sent), in seconds."""

    sent: float
    ttft: float = 0.0
    e2e: float = 0.0
    num_tokens: int = 0
    error: str | None = None


@dataclasses.dataclass(slots=True)
class BatchWatch:
    """What polling a batch saw: (t from its creation, completed, failed) samples and how it ended."""

    progress: list[tuple[float, int, int]] = dataclasses.field(default_factory=list)
    status: str = "validating"
    total: int = 0
    ended_s: float | None = None
    started: threading.Event = dataclasses.field(default_factory=threading.Event)
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)


def prompt(i: int) -> str:
    """The i-th interactive prompt: short, and different from every other (no prefix-cache hits past the
    chat template)."""
    return f"{ASKS[i % len(ASKS)].format(TOPICS[i // len(ASKS) % len(TOPICS)])} (#{i})"


def batch_line(i: int, model: str, max_tokens: int) -> dict[str, Any]:
    """One chat line of the batch's input file."""
    body = {
        "model": model,
        "messages": [
            {"role": "user", "content": f"Write a short note about {TOPICS[i % len(TOPICS)]}, item {i}."}
        ],
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    return {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def one_request(client: openai.OpenAI, model: str, text: str, max_tokens: int, start: float) -> RequestResult:
    """Streams one chat request; its TTFT and E2E, or the error that ended it."""
    sent = time.perf_counter()
    result = RequestResult(sent - start)
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        first = None
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
            if chunk.usage is not None:
                result.num_tokens = chunk.usage.completion_tokens
        end = time.perf_counter()
        if first is None:
            result.error = "no content"
        else:
            result.ttft, result.e2e = first - sent, end - sent
    except Exception as e:  # recorded and counted; the load goes on
        result.error = f"{type(e).__name__}: {e}"
    return result


def run_load(
    client: openai.OpenAI,
    model: str,
    clients: int,
    duration_s: float,
    max_tokens: int,
    counter: Iterator[int],
) -> list[RequestResult]:
    """--clients threads each sending one request after another until duration_s has passed."""
    start = time.perf_counter()
    end = start + duration_s
    per_thread: list[list[RequestResult]] = [[] for _ in range(clients)]

    def loop(mine: list[RequestResult]) -> None:
        while time.perf_counter() < end:
            mine.append(one_request(client, model, prompt(next(counter)), max_tokens, start))

    threads = [threading.Thread(target=loop, args=(mine,), daemon=True) for mine in per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted((r for mine in per_thread for r in mine), key=lambda r: r.sent)


def watch_batch(
    client: openai.OpenAI, batch_id: str, created: float, timeout_s: float, watch: BatchWatch
) -> None:
    """Polls the batch every POLL_S until it ends, the timeout passes or watch.stop is set."""
    deadline = created + timeout_s
    while not watch.stop.is_set():
        try:
            batch = client.batches.retrieve(batch_id)
        except openai.APIError:  # a slow or failed poll is skipped; the next one tells
            time.sleep(POLL_S)
            continue
        now = time.perf_counter() - created
        counts = batch.request_counts
        completed, failed = (counts.completed, counts.failed) if counts else (0, 0)
        watch.progress.append((round(now, 3), completed, failed))
        watch.status, watch.total = batch.status, counts.total if counts else 0
        if batch.status != "validating":
            watch.started.set()
        if batch.status in ENDED:
            watch.ended_s = now
            break
        if time.perf_counter() >= deadline:
            break
        time.sleep(POLL_S)
    watch.started.set()  # never leave the load waiting for a batch that will not start


def stats(values: list[float]) -> dict[str, float]:
    ms = [1000 * v for v in values] or [math.nan]
    return {f"p{q}": percentile(ms, q) for q in (50, 90, 99)} | {"mean": statistics.fmean(ms)}


def summarize(results: list[RequestResult], window: tuple[float, float] | None = None) -> dict[str, Any]:
    """A phase's figures; window: when it ran, in seconds from the batch's creation (the batch phase)."""
    ok = [r for r in results if r.error is None]
    if not ok:
        raise RuntimeError(f"every request failed: {results[0].error if results else 'none sent'}")
    duration = max(r.sent + r.e2e for r in ok)
    summary = {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "output_tokens": sum(r.num_tokens for r in ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "ttft_ms": stats([r.ttft for r in ok]),
        "e2e_ms": stats([r.e2e for r in ok]),
        "samples": [[round(r.sent, 4), round(1000 * r.ttft, 3), round(1000 * r.e2e, 3)] for r in ok],
    }
    return summary | ({"window_s": list(window)} if window else {})


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """os.environ with these entries, as scripts/run.sh inherits it; put back as it was afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_batch_phase(
    client: openai.OpenAI, model: str, args: argparse.Namespace, counter: Iterator[int]
) -> tuple[list[RequestResult], tuple[float, float], BatchWatch, dict[str, Any]]:
    """Creates the batch, runs the load while it is in progress, then waits for it to end."""
    lines = [batch_line(i, model, args.batch_max_tokens) for i in range(args.batch_lines)]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("batch_latency.jsonl", data), purpose="batch")
    created = time.perf_counter()
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    watch = BatchWatch()
    poller = threading.Thread(
        target=watch_batch, args=(client, batch.id, created, args.batch_timeout_s, watch), daemon=True
    )
    poller.start()
    watch.started.wait(args.batch_timeout_s)
    if watch.status in ENDED:
        print(f"warning: the batch ended ({watch.status}) before the interactive load began", flush=True)
    begin = time.perf_counter() - created
    results = run_load(client, model, args.clients, args.duration_s, args.max_tokens, counter)
    window = (begin, time.perf_counter() - created)
    print("interactive load with the batch: done; waiting for the batch to end", flush=True)
    poller.join(args.batch_timeout_s + POLL_S * 4)
    watch.stop.set()
    final = client.batches.retrieve(batch.id)
    ids = [uploaded.id, final.output_file_id, final.error_file_id]
    with contextlib.suppress(openai.APIError):  # best effort: the services' own run drops them anyway
        for file_id in filter(None, ids):
            client.files.delete(file_id)
    times = {"created_at": final.created_at, "in_progress_at": final.in_progress_at}
    times |= {"completed_at": final.completed_at, "failed_at": final.failed_at}
    return results, window, watch, {"id": batch.id, **times}


def batch_summary(watch: BatchWatch, window: tuple[float, float], record: dict[str, Any]) -> dict[str, Any]:
    seconds = watch.ended_s
    completed, failed = (watch.progress[-1][1], watch.progress[-1][2]) if watch.progress else (0, 0)
    overlap = max(0.0, min(window[1], seconds if seconds is not None else math.inf) - window[0])
    return {
        "status": watch.status,
        "lines": watch.total,
        "completed": completed,
        "failed": failed,
        "seconds": seconds,
        "lines_per_s": (watch.total / seconds) if seconds else None,
        "overlap_with_load_s": overlap,
        "record": record,
        "progress": [list(p) for p in watch.progress],
    }


def print_table(results: dict[str, Any]) -> None:
    print(f"{'phase':11} {'requests':>8} {'fail':>4} {'req/s':>6}  TTFT p50/p90/p99 ms      E2E p50/p99 ms")
    for name, label in (("no_batch", "no batch"), ("with_batch", "with batch")):
        r = results[name]
        ttft, e2e = r["ttft_ms"], r["e2e_ms"]
        print(
            f"{label:11} {r['requests']:8d} {r['failed']:4d} {r['request_throughput']:6.2f}  "
            f"{ttft['p50']:7.1f}/{ttft['p90']:7.1f}/{ttft['p99']:7.1f}  {e2e['p50']:8.1f}/{e2e['p99']:8.1f}"
        )
    verdict = "met" if results["target_met"] else "MISSED"
    print(
        f"TTFT with/without the batch: p50 {results['ttft_p50_ratio']:.2f}x "
        f"(target <= {TARGET_TTFT_P50_RATIO}: {verdict}), p99 {results['ttft_p99_ratio']:.2f}x"
    )
    b = results["batch"]
    rate = f"{b['lines_per_s']:.2f} lines/s" if b["lines_per_s"] else "n/a lines/s"
    seconds = f"{b['seconds']:.1f} s" if b["seconds"] is not None else "not ended"
    print(
        f"batch: {b['status']}, {b['lines']} lines ({b['completed']} completed, {b['failed']} failed) in "
        f"{seconds} ({rate}); running during {b['overlap_with_load_s']:.1f} s of the "
        f"{results['with_batch']['window_s'][1] - results['with_batch']['window_s'][0]:.1f} s loaded window"
    )


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    for color, (name, label) in zip(("C0", "C1"), (("no_batch", "no batch"), ("with_batch", "with batch"))):
        ttfts = sorted(s[1] for s in results[name]["samples"])
        left.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], color=color, label=label)
        for q, style in (("p50", "--"), ("p99", ":")):
            left.axvline(results[name]["ttft_ms"][q], color=color, linestyle=style, linewidth=1)
    left.set_xscale("log")
    left.xaxis.set_major_formatter(ScalarFormatter())
    left.xaxis.set_minor_formatter(ScalarFormatter())
    left.set_xlabel("TTFT (ms); dashed p50, dotted p99")
    left.set_ylabel("fraction of requests")
    left.set_title(
        f"TTFT: p50 {results['ttft_p50_ratio']:.2f}x, p99 {results['ttft_p99_ratio']:.2f}x with the batch"
    )
    left.legend(fontsize=8)
    progress = results["batch"]["progress"]
    right.plot([p[0] for p in progress], [p[1] for p in progress], color="C2", label="completed lines")
    if any(p[2] for p in progress):
        right.plot([p[0] for p in progress], [p[2] for p in progress], color="C3", label="failed lines")
    start, end = results["with_batch"]["window_s"]
    right.axvspan(start, end, color="C1", alpha=0.15, label="interactive load")
    right.set_xlabel("seconds from creating the batch")
    right.set_ylabel("lines")
    right.set_title(f"batch of {results['batch']['lines']} lines: {results['batch']['status']}")
    right.legend(fontsize=8)
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default=None, help="services already running there (default: start them)")
    parser.add_argument("--model", default=None, help="model folder or GGUF file (default: SmolLM2)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent interactive client threads")
    parser.add_argument("--duration-s", type=float, default=60.0, help="length of each interactive phase")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per interactive request")
    parser.add_argument("--batch-lines", type=int, default=500, help="lines of the batch")
    parser.add_argument("--batch-max-tokens", type=int, default=64, help="output tokens per batch line")
    parser.add_argument("--batch-timeout-s", type=float, default=1800.0, help="give up waiting for the batch")
    parser.add_argument(
        "--lines-in-flight", type=int, default=8, help="BATCH_LINES_IN_FLIGHT of the services started here"
    )
    parser.add_argument("--json", default="benchmarks/results/batch_latency.json")
    parser.add_argument("--plot", default="benchmarks/results/batch_latency.png")
    parser.add_argument("--log", default=None, help="the services' output (default: --json as .log)")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.batch_lines < 1 or args.duration_s <= 0:
        parser.error("--clients and --batch-lines must be at least 1, and --duration-s above 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    settings = WorkerSettings(**({"model": args.model} if args.model else {}))
    counter = itertools.count()
    services: Services | None = None
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            storage = stack.enter_context(tempfile.TemporaryDirectory(prefix="pagedserve-batch-latency-"))
            env = {"BATCH_LINES_IN_FLIGHT": str(args.lines_in_flight), "BATCH_STORAGE_DIR": storage}
            log = Path(args.log) if args.log else Path(args.json).with_suffix(".log")
            with environment(env):  # scripts/run.sh takes its environment when Services starts it
                services = Services(settings, log)
            services = stack.enter_context(services)
            url = services.url
        key = os.environ.get("API_KEY", "unused")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=3600)
        served = client.models.list().data[0].id
        # Warm-up: the same load for a few seconds, not measured (the first steps of a fresh worker are slow).
        run_load(client, served, args.clients, min(WARM_UP_S, args.duration_s), args.max_tokens, counter)
        no_batch = run_load(client, served, args.clients, args.duration_s, args.max_tokens, counter)
        print("interactive load without a batch: done", flush=True)
        with_batch, window, watch, record = run_batch_phase(client, served, args, counter)
    a, b = summarize(no_batch), summarize(with_batch, window)
    p50_ratio = b["ttft_ms"]["p50"] / a["ttft_ms"]["p50"]
    results = {
        "config": vars(args) | {"model": settings.model, "served_model": served},
        "url": url,
        "redis_prefix": services.keys.prefix if services else None,
        "redis_keys_left_by_services": services.keys_left if services else None,
        "no_batch": a,
        "with_batch": b,
        "batch": batch_summary(watch, window, record),
        "ttft_p50_ratio": p50_ratio,
        "ttft_p99_ratio": b["ttft_ms"]["p99"] / a["ttft_ms"]["p99"],
        "target_met": p50_ratio <= TARGET_TTFT_P50_RATIO,
    }
    print_table(results)
    if services and services.keys_left:
        print(f"keys the services left under their prefix (deleted): {services.keys_left}")
    out, png = Path(args.json), Path(args.plot)
    write_json(results, out)
    plot(results, png)
    print(f"wrote {out} and {png}")
    return results


if __name__ == "__main__":
    main()
