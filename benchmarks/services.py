"""The services for a benchmark: scripts/run.sh in a process group of its own, and what it leaves in Redis."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import redis

from gpu_worker.settings import WorkerSettings
from shared.keys import Keys
from shared.redis_client import connect
from shared.registry import WorkerRegistry

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 600  # a GGUF model is de-quantized on the first start
READY_BANNER = b"pagedserve is ready"  # what scripts/run.sh prints once the services answer /ready


def worker_blocks(redis_url: str, keys: Keys) -> int | None:
    """The KV pool size a live worker under these keys reports, if one does."""
    registry = WorkerRegistry(connect(redis_url, socket_connect_timeout=2), keys)
    with contextlib.suppress(redis.RedisError):
        for heartbeat in registry.read().live.values():
            return heartbeat.total_blocks
    return None


def kind_of(keys: Keys, name: str) -> str:
    """A key's name past the prefix (and past the control plane's hash tag)."""
    return name.removeprefix(keys.control + ":").removeprefix(keys.prefix + ":")


def delete_keys(redis_url: str, keys: Keys) -> dict[str, int]:
    """Deletes every key under the prefix; returns how many of each kind there were (ids as *)."""
    client = connect(redis_url, socket_connect_timeout=2)
    kinds: Counter[str] = Counter()
    with contextlib.suppress(redis.ConnectionError):  # a Redis that run.sh started is gone with it
        for pattern in keys.all_patterns():
            names = list(client.scan_iter(match=pattern, count=1000))
            kinds.update(
                re.sub(r"^(request|worker):(\{[^}]*\}|[^:]+)", r"\1:*", kind_of(keys, n)) for n in names
            )
            if names:
                client.delete(*names)
    return dict(kinds)


class Services:
    """scripts/run.sh in a process group of its own: Redis if none answers, scheduler, one worker, gateway."""

    def __init__(self, settings: WorkerSettings, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url, self.redis_url, self.log = f"http://127.0.0.1:{port}", settings.redis_url, log
        self.keys, self.keys_left = Keys(f"pagedserve-bench-{uuid.uuid4().hex[:10]}"), dict[str, int]()
        env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(port), "WORKERS": "1"}
        # The Redis run.sh starts when none answers keeps its files for this run only.
        self._redis_dir = tempfile.TemporaryDirectory(prefix="pagedserve-redis-")
        env.update(
            REDIS_URL=settings.redis_url, REDIS_PREFIX=self.keys.prefix, REDIS_DATA_DIR=self._redis_dir.name
        )
        if settings.model:
            env["MODEL"] = settings.model
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                ["bash", "scripts/run.sh"], cwd=ROOT, env=env, stdout=out, stderr=out, start_new_session=True
            )

    def __enter__(self) -> Services:
        # SIGTERM then unwinds through __exit__ like Ctrl-C, so the services never outlive this process.
        on_main = threading.current_thread() is threading.main_thread()
        self._sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler) if on_main else None
        try:
            # Ready once run.sh says so, not merely when /ready answers: until then run.sh polls /ready
            # itself, and a SIGTERM there stops the services but not the script's polling loop.
            deadline = time.monotonic() + READY_TIMEOUT_S
            while self.proc.poll() is None and time.monotonic() < deadline:
                if READY_BANNER in self.log.read_bytes():
                    return self
                time.sleep(0.5)
            raise RuntimeError(f"the services did not become ready; see {self.log}")
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                self.proc.poll()  # reaps run.sh; its children are reaped by it
                os.killpg(self.proc.pid, 0)  # ProcessLookupError once the whole group is gone
                time.sleep(0.1)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
        self.keys_left = delete_keys(self.redis_url, self.keys)
        self._redis_dir.cleanup()
