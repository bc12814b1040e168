"""`make compose-check`: build the images, start the suite in containers, and check it as an operator would.

    python docker/compose_check.py [--keep] [--sentinel]

On a host with no GPU and no registry: the base images come from Debian's packages (docker/base-images.sh),
the files pip needs from this host go to docker/local/, and the suite runs from
`docker-compose.yml` + `docker-compose.cpu.yml` (every container on the host's network). Checked against the
containers, in order:
  1. every service is healthy by its own health check;
  2. the official openai client gets a chat answer and a stream from the gateway;
  3. `--scale worker=2` registers two workers;
  4. a worker whose process is killed -9 is restarted by its policy, and a stream in flight on it completes
     on the other worker with the text of an uninterrupted run;
  5. `stop worker` drains: the workers take no new assignments, the streams in flight finish without an
     error, and every worker exits by itself (status 0) within its grace period;
  6. `down` leaves no container of the project.
With --sentinel, Redis runs as a primary, a replica and three Sentinels (docker-compose.sentinel-cpu.yml) and
the checks are: every service healthy; the client's chat answer and stream; the primary's container killed
mid-stream and left down (a lost host): the Sentinels promote the replica, the stream finishes with the text
of an uninterrupted run and a new request is served; the old primary, started again, comes back as the new
master's replica; `down`.
It prints how long each step took and the images' sizes, and exits non-zero at the first check that fails.
A Docker daemon is started (vfs storage, no bridge) when none answers. --keep leaves the project up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import redis

from shared.keys import Keys

REPO = Path(__file__).resolve().parent.parent
LOCAL = REPO / "docker" / "local"
PROJECT = "pagedserve-check"
FILES = ["-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml"]
PORT = int(os.environ.get("PORT", "8000"))
REDIS_PORT = int(os.environ.get("REDIS_PORT", "6390"))
BASE_URL = f"http://127.0.0.1:{PORT}"
MODEL = "SmolLM2-135M-Instruct"
KEYS = Keys("pagedserve")  # REDIS_PREFIX in docker-compose.yml
SERVICES = ("redis", "gateway", "batch", "scheduler", "worker")
IMAGES = ("pagedserve/service:0.1.0", "pagedserve/worker-cpu:0.1.0")
TORCH_WHEEL = "torch-2.13.0+cpu-cp311-*.whl"
STREAM_TOKENS = 64
DRAIN_GRACE_S = 75  # stop_grace_period of the worker in docker-compose.yml
HEALTHY_TIMEOUT_S = 900
SENTINEL_FILE = "docker-compose.sentinel-cpu.yml"
SENTINEL_SERVICES = ("redis-replica", "redis-sentinel-0", "redis-sentinel-1", "redis-sentinel-2")
REPLICA_PORT = int(os.environ.get("REDIS_REPLICA_PORT", "6391"))
SENTINEL_PORT = 26390  # redis-sentinel-0's
MASTER_NAME = "pagedserve"
DOWN_AFTER_S = 5.0  # down-after-milliseconds in docker-compose.sentinel-cpu.yml


class CheckFailed(Exception):
    pass


def log(message: str) -> None:
    print(f"compose-check: {message}", flush=True)


def run(*args: str, check: bool = True, capture: bool = False, timeout: float | None = None) -> str:
    result = subprocess.run(
        list(args), cwd=REPO, check=False, text=True, capture_output=capture, timeout=timeout
    )
    if check and result.returncode != 0:
        detail = f"\n{result.stdout}{result.stderr}" if capture else ""
        raise CheckFailed(f"`{' '.join(args)}` exited with {result.returncode}{detail}")
    return result.stdout if capture else ""


def compose(*args: str, capture: bool = False, timeout: float | None = None) -> str:
    return run("docker-compose", "-p", PROJECT, *FILES, *args, capture=capture, timeout=timeout)


# vfs storage copies an image's whole tree for each new container: a minute or more per worker.
os.environ.setdefault("COMPOSE_HTTP_TIMEOUT", "900")


def wait_for(what: str, condition: Callable[[], bool], timeout: float, every: float = 1.0) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise CheckFailed(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)
    return time.monotonic() - started


@contextmanager
def step(name: str, timings: dict[str, float]) -> Iterator[None]:
    started = time.monotonic()
    log(f"{name} ...")
    yield
    timings[name] = time.monotonic() - started
    log(f"{name}: ok in {timings[name]:.0f}s")


# -- the host: a Docker daemon, base images, what pip needs ------------------------------------------


def docker_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0


def ensure_daemon() -> None:
    if docker_answers():
        return
    if shutil.which("dockerd") is None:
        raise CheckFailed("no Docker daemon answers and dockerd is not installed (apt-get install docker.io)")
    log("starting dockerd (vfs storage, no bridge, no iptables)")
    logfile = open("/var/log/pagedserve-dockerd.log", "ab")  # noqa: SIM115 - the daemon owns it
    subprocess.Popen(
        ["dockerd", "--storage-driver=vfs", "--iptables=false", "--bridge=none"],
        stdout=logfile,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_for("dockerd", docker_answers, timeout=60)


def pip_setting(name: str) -> list[str]:
    """A value of pip's own configuration (global or the environment's PIP_*), split on whitespace."""
    env = os.environ.get(f"PIP_{name.upper().replace('-', '_')}")
    if env:
        return env.split()
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    values: list[str] = []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.split(".")[-1] == name:
            values += value.strip().strip("'\"").split()
    return values


def fill_local() -> None:
    """docker/local/: this host's CA bundle (pip's `cert`) and torch's CPU wheel (from pip's find-links)."""
    LOCAL.mkdir(exist_ok=True)
    (LOCAL / "wheels").mkdir(exist_ok=True)
    for cert in pip_setting("cert") or ["/etc/ssl/certs/ca-certificates.crt"]:
        if Path(cert).is_file():
            shutil.copyfile(cert, LOCAL / "ca-certificates.crt")
            break
    for folder in pip_setting("find-links"):
        for wheel in sorted(Path(folder.removeprefix("file://")).glob(TORCH_WHEEL)):
            target = LOCAL / "wheels" / wheel.name
            if not target.exists():
                shutil.copyfile(wheel, target)
    log(f"docker/local: {', '.join(sorted(p.name for p in LOCAL.rglob('*') if p.is_file()))}")


def image_size_mb(image: str) -> float:
    return int(run("docker", "image", "inspect", "-f", "{{.Size}}", image, capture=True)) / 1e6


# -- the containers ---------------------------------------------------------------------------------


def containers(service: str | None = None, all_states: bool = False) -> list[str]:
    labels = ["--filter", f"label=com.docker.compose.project={PROJECT}"]
    if service:
        labels += ["--filter", f"label=com.docker.compose.service={service}"]
    out = run("docker", "ps", "-q", *(["-a"] if all_states else []), *labels, capture=True)
    return out.split()


def inspect(container: str) -> dict[str, Any]:
    return json.loads(run("docker", "inspect", container, capture=True))[0]


def health(container: str) -> str:
    state = inspect(container)["State"]
    return state.get("Health", {}).get("Status", state["Status"])


def all_healthy(expected: dict[str, int]) -> bool:
    for service, count in expected.items():
        found = containers(service)
        if len(found) != count or any(health(c) != "healthy" for c in found):
            return False
    return True


def worker_id_of(container: str) -> str:
    status = run("docker", "exec", container, "cat", "/tmp/pagedserve/status.json", capture=True)
    return str(json.loads(status)["id"])


class Cluster:
    """The suite as a client and an operator see it: the gateway over HTTP, Redis on the host's loopback."""

    def __init__(self) -> None:
        self.client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="unused", max_retries=0, timeout=300)
        self.redis = redis.Redis(port=REDIS_PORT, decode_responses=True)

    def live_workers(self) -> dict[str, dict[str, str]]:
        beats = {}
        for wid in self.redis.smembers(KEYS.workers):
            beat = self.redis.hgetall(KEYS.worker(wid))
            if beat:
                beats[wid] = beat
        return beats

    def holder_of(self, fragment: str) -> list[str]:
        """Workers whose assignments include a request whose id contains fragment."""
        return [
            wid
            for wid in self.live_workers()
            if any(fragment in rid for rid in self.redis.hkeys(KEYS.assigned(wid)))
        ]

    def num_assigned(self) -> int:
        return sum(self.redis.hlen(KEYS.assigned(wid)) for wid in self.live_workers())


MESSAGES = [{"role": "user", "content": "Write a long story about the sea, the wind and a lighthouse."}]


def chat(cluster: Cluster, max_tokens: int = STREAM_TOKENS) -> str:
    out = cluster.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].message.content or ""


class Stream(threading.Thread):
    """A streamed chat completion read on a thread: its text and what went wrong."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.pieces: list[str] = []
        self.error: BaseException | None = None
        self.request_id = ""

    def run(self) -> None:
        try:
            stream = self.cluster.client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=STREAM_TOKENS,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                self.request_id = self.request_id or chunk.id
                self.pieces.extend(c.delta.content or "" for c in chunk.choices)
        except BaseException as e:  # reported by the check
            self.error = e

    @property
    def text(self) -> str:
        return "".join(self.pieces)


# -- the checks -------------------------------------------------------------------------------------


def check_serves(cluster: Cluster) -> str:
    answer = chat(cluster)
    if not answer:
        raise CheckFailed("the chat answer is empty")
    stream = Stream(cluster)
    stream.start()
    stream.join(300)
    if stream.error or stream.text != answer:
        raise CheckFailed(f"the stream differs from the answer (error {stream.error!r})")
    log(f"chat answer and stream agree: {answer[:60]!r}...")
    return answer


def check_scale(cluster: Cluster) -> None:
    compose("up", "-d", "--no-recreate", "--scale", "worker=2")
    wait_for("two healthy workers", lambda: all_healthy({"worker": 2}), HEALTHY_TIMEOUT_S, every=2)
    wait_for("two live workers", lambda: len(cluster.live_workers()) == 2, 60)
    log(f"two workers registered: {sorted(cluster.live_workers())}")


def check_kill(cluster: Cluster, expected: str) -> None:
    stream = Stream(cluster)
    stream.start()
    wait_for("tokens of the stream", lambda: len(stream.pieces) >= 20 or not stream.is_alive(), 120, 0.05)
    holders = cluster.holder_of(stream.request_id)
    if len(holders) != 1:
        raise CheckFailed(f"expected one worker to hold the stream, found {holders}")
    victim = next(c for c in containers("worker") if worker_id_of(c) == holders[0])
    restarts = inspect(victim)["RestartCount"]
    pid = inspect(victim)["State"]["Pid"]
    log(f"kill -9 of the worker process {pid} (container {victim[:12]}, worker {holders[0]})")
    os.kill(pid, signal.SIGKILL)
    stream.join(300)
    if stream.error or stream.text != expected:
        raise CheckFailed(
            f"the stream did not complete unchanged on the other worker (error {stream.error!r})"
        )
    log("the stream completed on the other worker with the text of an uninterrupted run")
    wait_for(
        "the killed worker restarted by its policy",
        lambda: inspect(victim)["RestartCount"] > restarts and health(victim) == "healthy",
        HEALTHY_TIMEOUT_S,
        every=2,
    )
    wait_for("two live workers", lambda: len(cluster.live_workers()) == 2, 60)
    log(f"container {victim[:12]} restarted (restart count {inspect(victim)['RestartCount']}) and healthy")


def check_drain(cluster: Cluster, expected: str) -> None:
    streams = [Stream(cluster) for _ in range(4)]
    for s in streams:
        s.start()
    wait_for("every stream under way", lambda: all(len(s.pieces) >= 5 for s in streams), 120, 0.05)
    workers = containers("worker")
    stopper = threading.Thread(target=compose, args=("stop", "worker"), daemon=True)
    started = time.monotonic()
    stopper.start()
    wait_for(
        "the workers' heartbeats to say draining",
        lambda: all(b.get("draining") == "true" for b in cluster.live_workers().values()),
        30,
        0.1,
    )
    held = cluster.num_assigned()
    late = Stream(cluster)  # sent during the drain: no draining worker may take it
    late.start()
    while stopper.is_alive():
        if cluster.num_assigned() > held:
            raise CheckFailed("a draining worker took a new request")
        held = min(held, cluster.num_assigned())
        time.sleep(0.1)
    stop_s = time.monotonic() - started
    for s in streams:
        s.join(60)
        if s.error or s.text != expected:
            raise CheckFailed(f"a stream in flight did not finish during the drain (error {s.error!r})")
    codes = [inspect(c)["State"]["ExitCode"] for c in workers]
    if codes != [0] * len(workers) or stop_s > DRAIN_GRACE_S:
        raise CheckFailed(f"the workers exited with {codes} after {stop_s:.0f}s (grace {DRAIN_GRACE_S}s)")
    log(f"drained: {len(streams)} streams finished, workers exited 0 after {stop_s:.0f}s")
    compose("up", "-d", "--scale", "worker=2")
    # With every worker gone it waits NO_WORKER_GRACE_S for one, then ends with its code.
    late.join(600)
    if late.error is None and late.text != expected:
        raise CheckFailed("the request sent during the drain came back changed")
    if late.error is not None and getattr(late.error, "code", None) != "no_worker":
        raise CheckFailed(f"the request sent during the drain failed: {late.error!r}")
    outcome = "served" if late.error is None else "no_worker (no worker left)"
    log(f"the request sent during the drain: {outcome}")
    wait_for("two healthy workers", lambda: all_healthy({"worker": 2}), HEALTHY_TIMEOUT_S, every=2)


def master_port(sentinel: redis.Redis) -> int | None:
    """The port of the master the Sentinel names (None while it cannot be asked)."""
    try:
        address = sentinel.sentinel_get_master_addr_by_name(MASTER_NAME)
    except redis.RedisError:
        return None
    return int(address[1]) if address else None


def replica_of(port: int, master: int) -> bool:
    """The Redis on port is a replica of the one on master, with its link up."""
    try:
        info = redis.Redis(port=port, decode_responses=True).info("replication")
    except redis.RedisError:
        return False
    return (
        info.get("role") == "slave"
        and int(info.get("master_port", 0)) == master
        and info.get("master_link_status") == "up"
    )


def check_failover(cluster: Cluster, expected: str) -> None:
    """kill -9 of the primary's process mid-stream: the Sentinels promote the replica, and no client sees it
    but as a pause."""
    sentinel = redis.Redis(port=SENTINEL_PORT, decode_responses=True)
    wait_for("the replica in sync", lambda: replica_of(REPLICA_PORT, REDIS_PORT), 60, 0.2)
    if master_port(sentinel) != REDIS_PORT:
        raise CheckFailed(f"the Sentinels name port {master_port(sentinel)} the master, not {REDIS_PORT}")
    stream = Stream(cluster)
    stream.start()
    wait_for("tokens of the stream", lambda: len(stream.pieces) >= 10 or not stream.is_alive(), 120, 0.05)
    primary = containers("redis")[0]
    # A lost host: the container killed (SIGKILL) and left down. A process that dies alone is restarted by
    # its policy within a second or two, too soon for the Sentinels (down-after 5 s) to fail it over.
    log(f"docker kill of the primary (container {primary[:12]}), {len(stream.pieces)} tokens in")
    killed = time.monotonic()
    run("docker", "kill", primary, capture=True)
    switch_s = wait_for("the replica promoted", lambda: master_port(sentinel) == REPLICA_PORT, 120, 0.1)
    log(f"the Sentinels promoted the replica {switch_s:.1f}s after the kill (down-after {DOWN_AFTER_S:g}s)")
    stream.join(300)
    if stream.error or stream.text != expected:
        raise CheckFailed(f"the stream did not finish unchanged across the failover (error {stream.error!r})")
    log(f"the stream finished unchanged {time.monotonic() - killed:.1f}s after the kill")
    answer = chat(cluster, max_tokens=8)
    if not expected.startswith(answer):
        raise CheckFailed(f"a request after the failover came back changed: {answer!r}")
    log(f"a new request was served {time.monotonic() - killed:.1f}s after the kill")
    run("docker", "start", primary, capture=True)  # the host is back: its Redis starts as a primary
    rejoined_s = wait_for(
        "the old primary a replica of the new master", lambda: replica_of(REDIS_PORT, REPLICA_PORT), 120, 0.5
    )
    log(f"the old primary came back as the new master's replica ({rejoined_s:.1f}s after its start)")
    if master_port(sentinel) != REPLICA_PORT:
        raise CheckFailed("the Sentinels went back to the old primary")


def check_down() -> None:
    compose("down", "-v", "--remove-orphans")
    left = containers(all_states=True)
    if left:
        raise CheckFailed(f"`down` left containers: {left}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keep", action="store_true", help="leave the project running at the end")
    parser.add_argument(
        "--sentinel", action="store_true", help=f"Redis under Sentinel ({SENTINEL_FILE}): a failover"
    )
    args = parser.parse_args()
    services = SERVICES + (SENTINEL_SERVICES if args.sentinel else ())
    if args.sentinel:
        FILES.extend(["-f", SENTINEL_FILE])
    timings: dict[str, float] = {}
    started = time.monotonic()
    try:
        with step("docker daemon", timings):
            ensure_daemon()
        with step("base images", timings):
            run("bash", "docker/base-images.sh")
            fill_local()
        with step("build", timings):
            compose("build")
        for image in IMAGES:
            log(f"image {image}: {image_size_mb(image):.0f} MB")
        cluster = Cluster()
        try:
            with step("up: every service healthy", timings):
                compose("up", "-d")
                wait_for(
                    "every service healthy",
                    lambda: all_healthy(dict.fromkeys(services, 1)),
                    HEALTHY_TIMEOUT_S,
                    every=2,
                )
            with step("openai client: chat answer and stream", timings):
                expected = check_serves(cluster)
            if args.sentinel:
                with step("kill -9 of the Redis primary mid-stream: a failover", timings):
                    check_failover(cluster, expected)
            else:
                with step("scale worker=2", timings):
                    check_scale(cluster)
                with step("kill -9 of a worker mid-stream", timings):
                    check_kill(cluster, expected)
                with step("stop worker: drain", timings):
                    check_drain(cluster, expected)
        except BaseException:
            subprocess.run(
                ["docker-compose", "-p", PROJECT, *FILES, "logs", "--tail", "40"], cwd=REPO, check=False
            )
            raise
        finally:
            if not args.keep:
                with step("down", timings):
                    check_down()
    except CheckFailed as e:
        log(f"FAILED: {e}")
        return 1
    log(
        f"passed in {time.monotonic() - started:.0f}s: "
        + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
