"""Two models on two workers, one flooded: the other's queue time stays what it is idle (benchmarks/routing.py
runs it as its `models` scenario).

One simulated worker serves model-a and one model-b (gpu_worker.simulation, SERVED_MODEL_NAME each). Probes
of model-b go one at a time straight into the requests stream; a probe's wait is from its queueing to the
first token in its record. The probes run with nothing else queued (idle), then again right after
FLOOD_REQUESTS requests of model-a were queued at once, a backlog that keeps model-a's worker busy for as
long as the probes take. The scheduler keeps a queue per model, so the probes never wait behind the flood.
"""

from __future__ import annotations

import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from control_plane import Processes, scheduler_stats, wait_for
from services import delete_keys

from shared.keys import Keys
from shared.protocol import GenerateRequest
from shared.redis_client import connect
from shared.registry import WorkerRegistry
from shared.sampling import SamplingSpec
from shared.streams import queue_request

MODELS = ("model-a", "model-b")
FLOOD_REQUESTS = 2000
FLOOD_TOKENS = 32  # per flooding request: the backlog outlasts the probes
PROBE_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
TARGET_RATIO = 2.0


def probe_waits(client: redis.Redis, keys: Keys, count: int, tag: str) -> list[float]:
    """Queue count probes of model-b, one at a time; each one's seconds from queueing to its first token."""
    waits = []
    spec = SamplingSpec(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i in range(count):
        rid = f"probe-{tag}-{i}"
        request = GenerateRequest(
            request_id=rid,
            prompt_token_ids=PROBE_PROMPT,
            sampling=spec,
            arrival_time=time.time(),
            model=MODELS[1],
        )
        sent = time.monotonic()
        queue_request(client, keys.requests, request)
        while not client.llen(keys.tokens(rid, 0)):
            if time.monotonic() - sent > 60:
                raise RuntimeError(f"probe {rid} got no token in 60 s")
            time.sleep(0.001)
        waits.append(time.monotonic() - sent)
    return waits


def run_models(base: dict[str, str], logs: Path, probes: int) -> dict[str, Any]:
    keys = Keys(f"pagedserve-models-{uuid.uuid4().hex[:8]}")
    env = {**base, "REDIS_PREFIX": keys.prefix, "NUM_KV_BLOCKS": "4096", "MAX_RUNNING_PER_WORKER": "256"}
    procs, client = Processes(env, logs), connect(base["REDIS_URL"])
    try:
        procs.start("models-scheduler", "scheduler_svc")
        for model in MODELS:
            procs.start(f"models-{model}", "gpu_worker.simulation", "--workers", "1", "--name", model,
                        "--step-ms", "20", SERVED_MODEL_NAME=model)  # fmt: skip
        registry = WorkerRegistry(client, keys)
        wait_for("the two workers", lambda: all(registry.live_worker_ids(m) for m in MODELS), 300)
        wait_for("the scheduler", lambda: registry.scheduler_stats() is not None)
        idle = probe_waits(client, keys, probes, "idle")
        spec = SamplingSpec(temperature=0.0, max_tokens=FLOOD_TOKENS, ignore_eos=True)
        pipe = client.pipeline(transaction=False)
        for i in range(FLOOD_REQUESTS):
            flood = GenerateRequest(
                request_id=f"flood-{i}",
                prompt_token_ids=[100 + i % 50, 7, 8, 9],
                sampling=spec,
                arrival_time=time.time(),
                model=MODELS[0],
            )
            queue_request(pipe, keys.requests, flood)
        pipe.execute()
        time.sleep(0.5)  # the scheduler has read the flood
        backlog = scheduler_stats(client, keys).waiting_by_model.get(MODELS[0], 0)
        flooded = probe_waits(client, keys, probes, "flooded")
        backlog_after = scheduler_stats(client, keys).waiting_by_model.get(MODELS[0], 0)
    finally:
        procs.stop()
        delete_keys(base["REDIS_URL"], keys)
    idle_ms, flooded_ms = 1000 * statistics.mean(idle), 1000 * statistics.mean(flooded)
    return {
        "probes": probes,
        "flood_requests": FLOOD_REQUESTS,
        "model_a_waiting_at_start": backlog,
        "model_a_waiting_at_end": backlog_after,
        "idle_ms_mean": idle_ms,
        "idle_ms_max": 1000 * max(idle),
        "flooded_ms_mean": flooded_ms,
        "flooded_ms_max": 1000 * max(flooded),
        "ratio": flooded_ms / idle_ms,
        "target_ratio": TARGET_RATIO,
    }


def print_table(result: dict[str, Any]) -> None:
    r = result
    print(
        f"\ntwo models, {r['flood_requests']} requests of {MODELS[0]} queued at once, "
        f"{r['probes']} probes of "
        f"{MODELS[1]}\n| | {MODELS[0]} waiting | {MODELS[1]} wait mean / max ms |\n| --- | --- | --- |\n"
        f"| idle | 0 | {r['idle_ms_mean']:.1f} / {r['idle_ms_max']:.1f} |\n"
        f"| flooded | {r['model_a_waiting_at_start']} to {r['model_a_waiting_at_end']} | "
        f"{r['flooded_ms_mean']:.1f} / {r['flooded_ms_max']:.1f} |\n"
        f"flooded / idle: {r['ratio']:.2f} (target <= {TARGET_RATIO:g}): "
        f"{'met' if r['ratio'] <= TARGET_RATIO else 'MISSED'}"
    )
