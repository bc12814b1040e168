"""The services as real processes over a real Redis, for the end-to-end and fault tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import openai
import redis
import requests

from shared.keys import Keys
from shared.protocol import Heartbeat
from shared.redis_client import connect
from shared.registry import WorkerRegistry

MODEL_NAME = "tiny-llama"
READY_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# How compose, `make run` and Kubernetes run Redis: every write in the append-only file, fsynced each second.
DURABLE_REDIS = ("--appendonly", "yes", "--appendfsync", "everysec", "--maxmemory-policy", "noeviction")


REDIS_START_TIMEOUT_S = 60  # a loaded CI machine has taken seconds to open the port


class RedisStartError(RuntimeError):
    """redis-server exited before it answered: its port taken meanwhile, most often."""


def start_redis_server(
    port: int, workdir: Path, durable: bool = False, extra: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """A redis-server of the test's own on port, answering when this returns: keeping its data in workdir
    (durable: as deployed) or nothing at all; extra: more of its options (--cluster-enabled ...)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    persistence = DURABLE_REDIS if durable else ("--appendonly", "no")
    log = workdir / f"redis-{port}.log"
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence, *extra]
        + ["--dir", str(workdir), "--logfile", str(log)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # Timeouts: a connect made before the server listens can meet itself on the port and wait forever.
    client = redis.Redis(port=port, socket_connect_timeout=1, socket_timeout=5)
    deadline = time.monotonic() + REDIS_START_TIMEOUT_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                client.ping()
                return proc
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.05)
    finally:
        client.close()
    exited = proc.poll() is not None
    proc.kill()
    proc.wait(timeout=10)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    if exited:
        raise RedisStartError(f"redis-server on port {port} exited ({proc.returncode}):\n{tail}")
    raise RuntimeError(f"redis-server on port {port} did not answer in {REDIS_START_TIMEOUT_S} s:\n{tail}")


def start_redis_on_a_free_port(
    workdir: Path, extra: Sequence[str] = (), tries: int = 3
) -> tuple[subprocess.Popen[bytes], int]:
    """start_redis_server on a port free when asked; another one when something took it before the server
    bound it (the port is free only until someone binds it). The last try's error is the one raised."""
    for _ in range(tries - 1):
        port = free_port()
        with contextlib.suppress(RedisStartError):
            return start_redis_server(port, workdir, extra=extra), port
    port = free_port()
    return start_redis_server(port, workdir, extra=extra), port


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (gunicorn's workers under the gateway's master)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


def command_lines(pids: list[int]) -> dict[int, str]:
    """Each live pid's command line, its arguments joined by spaces."""
    lines = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            lines[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    return lines


@dataclass
class Cluster:
    """The running services and how to reach them."""

    base_url: str
    redis: redis.Redis
    keys: Keys
    env: dict[str, str]
    logs: Path
    processes: dict[str, subprocess.Popen[bytes]]

    def start(self, name: str, *args: str, **extra_env: str) -> None:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - the process owns it
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", *args], env={**self.env, **extra_env}, stdout=log, stderr=subprocess.STDOUT
        )

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=120)

    def worker_ids(self) -> list[str]:
        """The workers started (and not killed) so far."""
        return [name for name, proc in self.processes.items() if name.startswith("w") and proc.poll() is None]

    def heartbeats(self) -> dict[str, Heartbeat]:
        return WorkerRegistry(self.redis, self.keys).read().live

    def wait_for_workers(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.heartbeats()) < count:
            assert time.monotonic() < deadline, f"fewer than {count} workers are live\n{self.logs_tail()}"
            time.sleep(0.2)

    def wait_ready(self, num_workers: int, timeout: float = READY_TIMEOUT_S) -> float:
        """Until the gateway answers /ready and num_workers are live; returns the seconds it took."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            with contextlib.suppress(requests.RequestException, redis.RedisError):
                ready = requests.get(f"{self.base_url}/ready", timeout=2).status_code == 200
                if ready and len(self.heartbeats()) >= num_workers:
                    return time.monotonic() - started
            time.sleep(0.2)
        raise AssertionError(f"the services did not become ready\n{self.logs_tail()}")

    def wait_idle(self, timeout: float = 60) -> dict[str, Heartbeat]:
        """Until every live worker reports nothing running and every block free."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            beats = self.heartbeats()
            if beats and all(
                b.num_running == b.num_waiting == 0 and b.free_blocks == b.total_blocks
                for b in beats.values()
            ):
                return beats
            time.sleep(0.2)
        raise AssertionError(f"workers did not drain: {self.heartbeats()}")

    def stop(self) -> None:
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        with contextlib.suppress(redis.RedisError):
            keys = list(self.redis.scan_iter(match=f"{self.keys.prefix}:*", count=1000))
            if keys:
                self.redis.delete(*keys)

    def logs_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.logs.glob("*.log")))


def service_env(redis_url: str, prefix: str, model: str, port: int, **overrides: str) -> dict[str, str]:
    """The environment every service of a test cluster reads its settings from."""
    return {
        **os.environ,
        "REDIS_URL": redis_url,
        "REDIS_PREFIX": prefix,
        "MODEL": model,
        "SERVED_MODEL_NAME": MODEL_NAME,
        "PORT": str(port),
        "GATEWAY_WORKERS": "2",
        "HEARTBEAT_TTL_S": "3",
        "HEARTBEAT_INTERVAL_S": "0.5",
        "SSE_HEARTBEAT_S": "0.5",
        "RESUME_GRACE_S": "1",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        # Tests compare streams with in-process runs and resumed runs token for token: exact in fp32, while
        # bf16 (auto's choice on a CPU with bf16 instructions) may part at near-ties between batch shapes.
        "DTYPE": "float32",
        **overrides,
    }


@contextlib.contextmanager
def running_cluster(
    env: dict[str, str], logs: Path, workers: tuple[str, ...], without_engine: dict[str, str]
) -> Iterator[Cluster]:
    """Scheduler, workers and gateway; the gateway and the scheduler run as their images do: without torch
    and the engine's packages."""
    c = Cluster(
        f"http://127.0.0.1:{env['PORT']}", connect(env["REDIS_URL"]), Keys(env["REDIS_PREFIX"]), env, logs, {}
    )
    try:
        c.start("scheduler", "scheduler_svc", **without_engine)
        for wid in workers:
            c.start(wid, "gpu_worker", WORKER_ID=wid)
        c.start("gateway", "gateway", **without_engine)
        c.wait_ready(len(workers))
        yield c
    finally:
        c.stop()
