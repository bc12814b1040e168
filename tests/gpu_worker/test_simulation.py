"""Simulated workers: the real worker service around a step-time model, many in a process, on a real Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import redis

from gpu_worker.engine.config import EngineConfig
from gpu_worker.engine.sampling_params import SamplingParams
from gpu_worker.settings import WorkerSettings
from gpu_worker.simulation import SimulatedWorkers, StepTime, next_token, simulated_engine
from shared.keys import Keys
from shared.protocol import GenerateRequest
from shared.records import parse_ends, parse_tokens
from shared.redis_client import connect
from shared.registry import WorkerRegistry
from shared.sampling import SamplingSpec
from shared.streams import queue_request
from tests.support import REPO

FAST = StepTime(fixed_s=0.002, per_token_s=0.00001)
ROOT = REPO


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    return [next_token(prompt[0], len(prompt) + i) for i in range(max_tokens)]


def test_the_simulated_engine_schedules_for_real_and_frees_every_block() -> None:
    engine = simulated_engine(EngineConfig(num_kv_blocks=64, block_size=16), FAST)
    prompts = {f"r{i}": [i + 1] * (10 + 7 * i) for i in range(6)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=20))
    while engine.has_unfinished_requests():
        engine.step()
    for rid, prompt in prompts.items():
        (seq,) = engine.release(rid)
        assert seq.output_token_ids == expected_tokens(prompt, 20) and seq.finish_reason == "length"
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks == 64


def submit(client: redis.Redis, keys: Keys, rid: str, prompt: list[int], max_tokens: int) -> None:
    spec = SamplingSpec(temperature=0.0, max_tokens=max_tokens)
    request = GenerateRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=spec, arrival_time=time.time()
    )
    queue_request(client, keys.requests, request)


def wait_until_done(client: redis.Redis, keys: Keys, rids: list[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    pending = set(rids)
    while pending:
        assert time.monotonic() < deadline, f"{len(pending)} requests never finished"
        pipe = client.pipeline(transaction=False)
        order = sorted(pending)
        for rid in order:
            pipe.hlen(keys.finished(rid))
        pending = {rid for rid, n in zip(order, pipe.execute()) if not n}
        time.sleep(0.05)


def check_records(client: redis.Redis, keys: Keys, prompts: dict[str, list[int]], max_tokens: int) -> None:
    """Every request's record holds exactly its tokens, once, and its end."""
    for rid, prompt in prompts.items():
        tokens = parse_tokens(client.lrange(keys.tokens(rid, 0), 0, -1))  # type: ignore[arg-type]
        assert tokens == expected_tokens(prompt, max_tokens), rid
        ends = parse_ends(client.hgetall(keys.finished(rid)))  # type: ignore[arg-type]
        assert ends[0].finish_reason == "length", rid


def worker_settings(redis_url: str, prefix: str) -> WorkerSettings:
    return WorkerSettings(
        redis_url=redis_url, redis_prefix=prefix, num_kv_blocks=256, heartbeat_interval_s=0.2
    )  # type: ignore[call-arg]


@pytest.mark.usefixtures("scheduler")
def test_simulated_workers_serve_through_the_real_services(redis_url: str, keys: Keys) -> None:
    client = connect(redis_url)
    workers = SimulatedWorkers(worker_settings(redis_url, keys.prefix), 8, FAST, "sim")
    workers.start()
    try:
        prompts = {f"r{i}": [i % 50 + 1] * (5 + i % 40) for i in range(200)}
        for rid, prompt in prompts.items():
            submit(client, keys, rid, prompt, 6)
        wait_until_done(client, keys, list(prompts))
        check_records(client, keys, prompts, 6)
        served = {s.worker_id: s.table.prompt_tokens_total for s in workers.services}
        assert sum(1 for tokens in served.values() if tokens) >= 4  # spread over the workers
        deadline = time.monotonic() + 10
        while True:  # once every worker has sent the heartbeat that counts its last take-in
            beats = WorkerRegistry(client, keys).read().live
            idle = all(b.free_blocks == b.total_blocks and not b.num_running for b in beats.values())
            reserved = [int(client.get(keys.reserved(w)) or 0) for w in beats]
            if len(beats) == 8 and idle and not any(reserved):
                break
            assert time.monotonic() < deadline, (beats, reserved)
            time.sleep(0.1)
    finally:
        workers.stop()


@pytest.mark.usefixtures("scheduler")
def test_a_killed_process_of_simulated_workers_loses_no_request(redis_url: str, keys: Keys) -> None:
    """kill -9 of a process running simulated workers, under load: every request still ends, with exactly
    its tokens (the others resume them from their records)."""
    client = connect(redis_url)
    env = {**os.environ, "REDIS_URL": redis_url, "REDIS_PREFIX": keys.prefix, "NUM_KV_BLOCKS": "256"}
    env.update(HEARTBEAT_TTL_S="1", HEARTBEAT_INTERVAL_S="0.2", LOG_LEVEL="WARNING")
    victim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpu_worker.simulation",
            "--workers",
            "4",
            "--name",
            "doomed",
            "--step-ms",
            "20",
        ],
        env=env,
        cwd=ROOT,
    )
    survivors = SimulatedWorkers(
        worker_settings(redis_url, keys.prefix).model_copy(update={"heartbeat_ttl_s": 1.0}),
        4,
        StepTime(0.02, 0),
        "kept",
    )
    try:
        deadline = time.monotonic() + 30
        while len(WorkerRegistry(client, keys).live_worker_ids()) < 4:
            assert time.monotonic() < deadline and victim.poll() is None, (
                "the simulated workers did not start"
            )
            time.sleep(0.1)
        survivors.start()
        prompts = {f"k{i}-{uuid.uuid4().hex[:6]}": [i % 50 + 1] * (5 + i % 30) for i in range(120)}
        for rid, prompt in prompts.items():
            submit(client, keys, rid, prompt, 30)
        time.sleep(0.5)  # well into their generations
        held = sum(client.hlen(keys.assigned(f"doomed-{i}")) for i in range(4))  # type: ignore[misc]
        assert held > 0, "the doomed workers hold nothing to lose"
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        wait_until_done(client, keys, list(prompts), timeout=90)
        check_records(client, keys, prompts, 30)
    finally:
        if victim.poll() is None:
            victim.kill()
        survivors.stop()
