"""Container health checks read the same keys the services write."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from shared import health
from shared.keys import Keys
from shared.protocol import Heartbeat, SchedulerStats
from tests.support import REPO


def beat(wid: str) -> Heartbeat:
    return Heartbeat(
        worker_id=wid,
        model="m",
        free_blocks=1,
        total_blocks=1,
        block_size=16,
        num_running=0,
        num_waiting=0,
        last_step_time=0.0,
        started_at=time.time(),
        max_model_len=2048,
    )


def test_health_checks(monkeypatch: pytest.MonkeyPatch, redis_url: str, keys: Keys) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("REDIS_PREFIX", keys.prefix)
    client = redis.Redis.from_url(redis_url)
    assert health.main(["worker"]) == 1
    assert health.main(["scheduler"]) == 1
    assert health.main(["nonsense"]) == 2

    wid = f"{socket.gethostname()}-123"
    client.hset(keys.worker(wid), mapping=beat(wid).to_hash())  # type: ignore[arg-type]
    client.sadd(keys.workers, wid)
    assert health.main(["worker"]) == 0
    stats = SchedulerStats(num_waiting=0, num_assigned=0, updated_at=time.time())
    client.hset(keys.scheduler_stats, mapping=stats.to_hash())  # type: ignore[arg-type]
    assert health.main(["scheduler"]) == 0


def test_status_file_checks(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, keys: Keys, tmp_path: Path
) -> None:
    """--live reads only the status file; readiness also wants the heartbeat of the worker the file names."""
    path = tmp_path / "status.json"
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("REDIS_PREFIX", keys.prefix)
    assert health.main(["worker", "--live"]) == 2  # no STATUS_FILE: nothing to look at
    monkeypatch.setenv("STATUS_FILE", str(path))
    assert health.main(["worker", "--live"]) == 1  # not written yet (a model still loading)
    reporter = health.StatusReporter(str(path), "worker", "w-status", state=lambda: "serving").start()
    try:
        assert health.main(["worker", "--live"]) == 0
        assert health.main(["scheduler", "--live"]) == 1  # another service's file
        assert health.main(["worker"]) == 1  # live, but not registered
        client = redis.Redis.from_url(redis_url)
        client.hset(keys.worker("w-status"), mapping=beat("w-status").to_hash())  # type: ignore[arg-type]
        client.sadd(keys.workers, "w-status")
        assert health.main(["worker"]) == 0
        status = health.StatusFile(path).read()
        assert status is not None and status.id == "w-status" and status.state == "serving"
        assert not health.is_live(status, "worker", now=status.time + health.LIVE_WINDOW_S + 1)
    finally:
        reporter.stop()
    assert not path.exists()
    assert health.main(["worker", "--live"]) == 1


def test_a_hung_process_stops_being_live(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    hung = threading.Event()
    reporter = health.StatusReporter(
        str(path), "worker", "w", state=lambda: "serving", alive=lambda: not hung.is_set()
    )
    reporter.start()
    try:
        first = health.StatusFile(path).read()
        hung.set()
        time.sleep(2.5 * health.STATUS_INTERVAL_S)
        assert health.StatusFile(path).read() == first  # no longer refreshed
        hung.clear()
        time.sleep(1.5 * health.STATUS_INTERVAL_S)
        later = health.StatusFile(path).read()
        assert later is not None and first is not None and later.time > first.time
    finally:
        reporter.stop()


DRAINED_CHILD = """
import signal, sys, time
from shared.health import StatusReporter
reporter = StatusReporter(sys.argv[1], "worker", "w-drain", state=lambda: "serving").start()
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(time.monotonic()))
while not stop:
    time.sleep(0.05)
time.sleep(1.0)  # finishing what it holds
reporter.stop()
"""


def test_drain_asks_the_worker_to_stop_and_waits_for_it(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    child = subprocess.Popen([sys.executable, "-c", DRAINED_CHILD, str(path)], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not path.exists():
            assert time.monotonic() < deadline and child.poll() is None, "the worker did not start"
            time.sleep(0.05)
        env = {**os.environ, "STATUS_FILE": str(path), "DRAIN_TIMEOUT_S": "10"}
        started = time.monotonic()
        drained = subprocess.run([sys.executable, "-m", "shared.drain"], cwd=REPO, env=env, timeout=60)
        assert drained.returncode == 0
        assert time.monotonic() - started >= 1.0  # it waited for the drain, not just for the signal
        assert child.wait(5) == 0
        # Nothing left to drain.
        again = subprocess.run([sys.executable, "-m", "shared.drain"], cwd=REPO, env=env, timeout=60)
        assert again.returncode == 2
    finally:
        child.kill()
