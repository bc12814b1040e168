"""Simulated workers: the real worker service around a step-time model, many in a process, on a real Redis."""

from __future__ import annotations

import time

import pytest

from gpu_worker.engine.config import EngineConfig
from gpu_worker.engine.sampling_params import SamplingParams
from gpu_worker.simulation import SimulatedWorkers, simulated_engine
from shared.keys import Keys
from shared.redis_client import connect
from shared.registry import WorkerRegistry
from tests.support.simulated import (
    FAST,
    check_records,
    expected_tokens,
    submit,
    wait_until_done,
    worker_settings,
)


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
