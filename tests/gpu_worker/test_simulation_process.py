"""A process of simulated workers killed with kill -9 under load: the others resume every request."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from gpu_worker.simulation import SimulatedWorkers, StepTime
from shared.keys import Keys
from shared.redis_client import connect
from shared.registry import WorkerRegistry
from tests.support import REPO
from tests.support.simulated import check_records, submit, wait_until_done, worker_settings


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
        cwd=REPO,
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
