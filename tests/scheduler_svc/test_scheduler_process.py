"""The scheduler as its own process (`python -m scheduler_svc`): it assigns, lists its settings, stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import redis

from shared.keys import Keys
from tests.support import REPO
from tests.support.scheduler_stage import heartbeat, inbox_rids, make_request, submit


def test_help_lists_environment_names() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "scheduler_svc", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in ("REDIS_URL", "REDIS_PREFIX", "WATERMARK_BLOCKS", "POLL_INTERVAL_S", "CLAIM_IDLE_S"):
        assert name in out


def test_service_process_assigns_and_stops_on_sigterm(
    redis_url: str, redis_prefix: str, r: redis.Redis, keys: Keys
) -> None:
    env = {**os.environ, "REDIS_URL": redis_url, "REDIS_PREFIX": redis_prefix, "POLL_INTERVAL_S": "0.02"}
    heartbeat(r, keys, "w1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "scheduler_svc"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        submit(r, keys, make_request("over-the-wire"))
        deadline = time.monotonic() + 15
        while not inbox_rids(r, keys, "w1") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert inbox_rids(r, keys, "w1") == ["over-the-wire"]
        # The stats are written after the assignment they count: awaited, not read at once.
        while not r.exists(keys.scheduler_stats) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.exists(keys.scheduler_stats)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output
    assert "stopped" in output
