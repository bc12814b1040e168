"""Simulated workers (gpu_worker.simulation) in the tests: their settings, requests submitted to them, and
the records their outputs must leave."""

from __future__ import annotations

import time

import redis

from gpu_worker.settings import WorkerSettings
from gpu_worker.simulation import StepTime, next_token
from shared.keys import Keys
from shared.protocol import GenerateRequest
from shared.records import parse_ends, parse_tokens
from shared.sampling import SamplingSpec
from shared.streams import queue_request

FAST = StepTime(fixed_s=0.002, per_token_s=0.00001)


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    return [next_token(prompt[0], len(prompt) + i) for i in range(max_tokens)]


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
