"""Faults injected into the real processes: a Redis of the module's own that freezes, dies and comes back
(empty, or from its append-only file as deployed); workers that die. No service exits, and no request
hangs: each finishes, or ends with a coded error; with a Redis that keeps its data, each finishes as it
would have."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from gpu_worker import LLM, SamplingParams
from gpu_worker.settings import WorkerSettings
from tests.support import REPO
from tests.support.batch_cluster import chat_line, submit, wait_until
from tests.support.cluster import (
    MODEL_NAME,
    Cluster,
    command_lines,
    free_port,
    process_tree,
    running_cluster,
    service_env,
    start_redis_server,
)

PROMPT = "Paged attention stores the KV cache in blocks"
MAX_TOKENS = 200
DURABLE_RUNNING = 2  # requests the durable cluster's worker holds at once


@dataclass
class FaultCluster:
    """A cluster over a Redis the tests may stop, kill and start again on the same port."""

    cluster: Cluster
    redis_proc: subprocess.Popen[bytes]
    redis_port: int
    redis_dir: Path
    durable: bool = False

    def restart_redis(self, down_s: float) -> None:
        """kill -9, then start again on the same port and folder: empty, or from its files when durable."""
        self.redis_proc.kill()
        self.redis_proc.wait()
        time.sleep(down_s)
        self.redis_proc = start_redis_server(self.redis_port, self.redis_dir, durable=self.durable)

    def assert_all_alive(self) -> None:
        dead = {name: p.returncode for name, p in self.cluster.processes.items() if p.poll() is not None}
        assert not dead, f"services exited: {dead}\n{self.cluster.logs_tail()}"


@pytest.fixture(scope="module")
def faults(
    tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory, without_engine: dict[str, str]
) -> Iterator[FaultCluster]:
    port = free_port()
    redis_dir = tmp_path_factory.mktemp("fault-redis")
    proc = start_redis_server(port, redis_dir)
    env = service_env(
        f"redis://127.0.0.1:{port}/0",
        f"pagedserve-faults-{uuid.uuid4().hex[:8]}",
        tiny_model_path,
        free_port(),
        GATEWAY_WORKERS="1",
        NUM_KV_BLOCKS="128",
        NO_WORKER_GRACE_S="2",
        REDIS_OUTAGE_GRACE_S="20",
        BATCH_STORAGE_DIR=str(redis_dir / "files"),
        BATCH_VISIBILITY_TIMEOUT_S="12",
        BATCH_SLICE_S="3",
    )
    fault = None
    try:
        with running_cluster(env, tmp_path_factory.mktemp("fault-logs"), ("w1",), without_engine) as cluster:
            cluster.start("batch", "gateway.batch", **without_engine)
            fault = FaultCluster(cluster, proc, port, redis_dir)
            yield fault
    finally:
        (fault.redis_proc if fault else proc).kill()


@pytest.fixture(scope="module")
def expected_text(tiny_model_path: str) -> str:
    llm = LLM(tiny_model_path, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text


@pytest.fixture(scope="module")
def durable(
    tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory, without_engine: dict[str, str]
) -> Iterator[FaultCluster]:
    """A cluster over a Redis with its append-only file, whose worker holds two requests at a time: the rest
    wait in the scheduler's queue."""
    port = free_port()
    redis_dir = tmp_path_factory.mktemp("durable-redis")
    proc = start_redis_server(port, redis_dir, durable=True)
    env = service_env(
        f"redis://127.0.0.1:{port}/0",
        f"pagedserve-durable-{uuid.uuid4().hex[:8]}",
        tiny_model_path,
        free_port(),
        GATEWAY_WORKERS="1",
        NUM_KV_BLOCKS="128",
        MAX_RUNNING_PER_WORKER=str(DURABLE_RUNNING),
        REDIS_OUTAGE_GRACE_S="30",
    )
    fault = None
    try:
        with running_cluster(
            env, tmp_path_factory.mktemp("durable-logs"), ("w1",), without_engine
        ) as cluster:
            fault = FaultCluster(cluster, proc, port, redis_dir, durable=True)
            yield fault
    finally:
        (fault.redis_proc if fault else proc).kill()


@dataclass
class Stream:
    """A streamed completion read on a thread: its text, its error event, when it ended."""

    text: list[str] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    ended_at: float = 0.0


def start_stream(cluster: Cluster, **extra: Any) -> Stream:
    stream = Stream()
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }

    def read() -> None:
        try:
            with requests.post(
                f"{cluster.base_url}/v1/completions", json=body, stream=True, timeout=120
            ) as r:
                for line in r.iter_lines():
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[len(b"data: ") :])
                    if "error" in chunk:
                        stream.errors.append(chunk["error"])
                    else:
                        stream.text.extend(c["text"] for c in chunk["choices"])
        finally:
            stream.ended_at = time.monotonic()
            stream.done.set()

    threading.Thread(target=read, daemon=True).start()
    return stream


def wait_for_tokens(stream: Stream, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(stream.text) < count:
        assert not stream.done.is_set(), f"the stream ended early: {stream.errors}"
        assert time.monotonic() < deadline, "no tokens came"
        time.sleep(0.02)


def complete(cluster: Cluster) -> str:
    out = cluster.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    return out.choices[0].text


def test_a_frozen_redis_delays_a_stream_but_loses_nothing(faults: FaultCluster, expected_text: str) -> None:
    stream = start_stream(faults.cluster)
    wait_for_tokens(stream, 10)
    faults.redis_proc.send_signal(signal.SIGSTOP)
    time.sleep(3)
    faults.redis_proc.send_signal(signal.SIGCONT)
    assert stream.done.wait(60), "the stream hangs"
    assert not stream.errors and "".join(stream.text) == expected_text
    faults.assert_all_alive()


def test_redis_restarted_empty_loses_no_stream_and_the_services_recover(
    faults: FaultCluster, expected_text: str
) -> None:
    cluster = faults.cluster
    stream = start_stream(cluster)
    wait_for_tokens(stream, 10)
    killed_at = time.monotonic()
    faults.restart_redis(down_s=3)
    # In flight: the request went with Redis, so the gateway sends it again, resumed from what it streamed.
    assert stream.done.wait(60), "the stream hangs"
    assert not stream.errors and "".join(stream.text) == expected_text, stream.errors
    faults.assert_all_alive()
    # The services find the new Redis: the worker registers again, and new requests are served.
    recovered_s = cluster.wait_ready(1, timeout=60)
    assert expected_text.startswith(complete(cluster))
    served_s = time.monotonic() - killed_at
    print(f"served again {served_s:.1f} s after the kill ({recovered_s:.1f} s after the restart)")
    # The batch worker (Celery) rode out the outage too: a batch sent now runs.
    lines = [chat_line(f"after-{i}", PROMPT) for i in range(5)]
    done = wait_until(
        cluster.client(), submit(cluster.client(), lines).id, {"completed", "failed"}, timeout=90
    )
    assert done.status == "completed" and done.request_counts.completed == 5, done
    faults.assert_all_alive()


def test_redis_killed_and_restarted_from_its_files_loses_no_request(
    durable: FaultCluster, expected_text: str
) -> None:
    cluster = durable.cluster
    streams = [start_stream(cluster) for _ in range(3 * DURABLE_RUNNING)]
    deadline = time.monotonic() + 120
    while sum(len(s.text) >= 10 for s in streams) < DURABLE_RUNNING:
        assert time.monotonic() < deadline, f"no stream started: {[s.errors for s in streams]}"
        time.sleep(0.02)
    # Two stream, the rest wait in the scheduler's queue (the worker holds two at a time).
    waiting = [s for s in streams if not s.text]
    assert len(waiting) >= DURABLE_RUNNING, [len(s.text) for s in streams]
    durable.restart_redis(down_s=3)
    for stream in streams:
        assert stream.done.wait(300), f"a stream hangs\n{cluster.logs_tail()}"
    # Each streamed and each queued request finishes with exactly the text it would have had.
    assert [s.errors for s in streams] == [[]] * len(streams)
    assert ["".join(s.text) for s in streams] == [expected_text] * len(streams)
    durable.assert_all_alive()


def test_with_no_worker_left_a_stream_ends_with_no_worker(faults: FaultCluster) -> None:
    cluster = faults.cluster
    stream = start_stream(cluster, max_tokens=2000)
    wait_for_tokens(stream, 5)
    worker = cluster.processes["w1"]
    worker.kill()
    worker.wait()
    killed_at = time.monotonic()
    # The heartbeat lapses (HEARTBEAT_TTL_S 3), then the grace (NO_WORKER_GRACE_S 2) runs out.
    assert stream.done.wait(30), "the stream hangs"
    assert [e["code"] for e in stream.errors] == ["no_worker"], stream.errors
    assert stream.ended_at - killed_at < 3 + 2 + 3
    response = requests.post(
        f"{cluster.base_url}/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT}, timeout=10
    )
    assert response.status_code == 503 and response.json()["error"]["code"] == "no_worker"
    assert response.headers["Retry-After"]
    cluster.processes.pop("w1")
    faults.assert_all_alive()


def test_make_run_starts_a_crashed_service_again(tiny_model_path: str, tmp_path: Path) -> None:
    """scripts/run.sh (`make run`) supervises what it starts: a service killed with -9 (and its own Redis) is
    started again, and the whole set still serves."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from services import Services

    settings = WorkerSettings(model=tiny_model_path, redis_url=f"redis://127.0.0.1:{free_port()}/0")
    with Services(settings, tmp_path / "run.log") as services:

        def find(needle: str) -> list[int]:
            return [
                pid for pid, line in command_lines(process_tree(services.proc.pid)).items() if needle in line
            ]

        for needle in ("-m scheduler_svc", "redis-server"):
            (old,) = find(needle)
            os.kill(old, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while not [pid for pid in find(needle) if pid != old]:
                assert time.monotonic() < deadline, f"{needle} was not started again"
                time.sleep(0.2)
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(openai.APIError):
                out = openai.OpenAI(
                    base_url=f"{services.url}/v1", api_key="x", max_retries=0
                ).completions.create(
                    model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=4, temperature=0
                )
                break
            assert time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.5)
        assert out.usage is not None and out.usage.completion_tokens == 4
    log = (tmp_path / "run.log").read_text()
    assert "scheduler exited with status 137; starting it again" in log
    assert "redis-server exited with status 137; starting it again" in log
